"""Softmax and log-softmax (``aten::_softmax`` / ``aten::_log_softmax`` and their
``_backward_data`` ops): the float64 reference that the native grafts are tested against. The
grafts themselves are native (Rust and CUDA C++, ``crates/graft-native/src/grafts/softmax``);
nothing here runs on the call path."""
