"""RMSNorm with a model's own numerics: ``torch.ops.torchgraft.rms_norm`` (one kernel forward,
one backward), the weight applied as Llama (``weight * xhat.to(dtype)``) or Gemma
(``(xhat * (1 + weight.float())).to(dtype)``) write it.

``reference`` holds the float64 reference and the eager expressions models write; ``fake``
and ``autograd`` give the op its fake functions and autograd (kernels: Rust on CPU, CUDA C++ on
CUDA; crates/graft-native/src/ops/rms_norm/). The public function is
``torchgraft.functional.rms_norm``.
"""
