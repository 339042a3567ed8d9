"""Fused Adam / AdamW (``aten::_fused_adam_`` / ``aten::_fused_adamw_``): the float64 reference
that the native grafts are tested against. The grafts themselves are native (Rust and CUDA C++,
``crates/graft-native/src/grafts/adam``); nothing here runs on the call path."""
