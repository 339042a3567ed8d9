"""Gated linear units: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu(gate) * up``.

``reference`` holds the float64 reference; ``custom_op`` gives ``torch.ops.torchgraft.swiglu`` /
``geglu`` their autograd and fake functions (kernels: Rust on CPU, CUDA C++ on CUDA).
"""
