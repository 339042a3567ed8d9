"""LayerNorm (``aten::native_layer_norm`` / ``aten::native_layer_norm_backward``): the float64
reference that the native grafts are tested against. The grafts themselves are native (Rust and
CUDA C++, ``crates/graft-native/src/grafts/layer_norm``); nothing here runs on the call path."""
