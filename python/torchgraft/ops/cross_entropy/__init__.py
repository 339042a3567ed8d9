"""Cross-entropy over (N, V) logits in one pass, its gradient computed in the forward.

``reference`` holds the float64 reference; ``fake`` and ``autograd`` give
``torch.ops.torchgraft.cross_entropy`` (and its in-place variant, and the backward's
``scale_grad``) their fake functions and autograd (kernels: Rust on CPU, CUDA C++ on CUDA).
"""
