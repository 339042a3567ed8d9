"""Mixture-of-experts routing with sigmoid scores and group-limited top-k (DeepSeek-V3's and
GLM-4-MoE's routers): ``sigmoid(logits)``, a correction bias that steers the choice, the best
groups of experts, the ``k`` best experts in them, renormalized and scaled.

``reference`` holds the eager composite (what the models write, in torch's ops); ``fake`` and
``autograd`` give ``torch.ops.torchgraft.topk_sigmoid`` its fake function and autograd
(kernels: Rust on CPU, CUDA C++ on CUDA).
"""
