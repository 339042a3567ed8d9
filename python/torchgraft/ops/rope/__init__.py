"""Rotary position embedding in transformers' ``rotate_half`` convention, q and k together.

``reference`` holds the float64 reference; ``fake`` and ``autograd`` give
``torch.ops.torchgraft.rope`` its fake functions and autograd (kernels: Rust on CPU, CUDA C++
on CUDA).
"""
