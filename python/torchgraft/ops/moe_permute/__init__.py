"""Mixture-of-experts token permutation: the ``(token, k)`` pairs' hidden rows gathered into
expert order (``moe_permute``), and the experts' output rows put back and summed per token with
the routing weights (``moe_unpermute``), as transformers' ``grouped_mm`` experts do around their
grouped GEMMs.

``reference`` holds the definitions in torch's own ops (with ``moe_sort_reference``, which
makes the permutation); ``fake`` and ``autograd`` give ``torch.ops.torchgraft.moe_sort`` /
``moe_permute`` / ``moe_unpermute`` their fake functions and autograd (kernels: Rust on CPU,
CUDA C++ on CUDA).
"""
