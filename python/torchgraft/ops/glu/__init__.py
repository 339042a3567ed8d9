"""Gated linear units: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu(gate) * up``.

``reference`` holds the float64 reference; ``fake`` and ``autograd`` give
``torch.ops.torchgraft.swiglu`` / ``geglu`` their fake functions and autograd (kernels: Rust on
CPU, CUDA C++ on CUDA).
"""
