"""Rotary position embedding in transformers' ``rotate_half`` convention, q and k together.

``reference`` holds the float64 reference; ``custom_op`` gives ``torch.ops.torchgraft.rope`` its
autograd and fake functions (kernels: Rust on CPU, CUDA C++ on CUDA).
"""
