"""Mixture-of-experts routing: softmax over each row of router logits, the ``k`` largest
probabilities and their experts, optionally renormalized (Qwen3-MoE's, Mixtral's, OLMoE's).

``reference`` holds the eager composite (what the models write) and its float64 form; ``fake``
and ``autograd`` give ``torch.ops.torchgraft.topk_softmax`` its fake function and autograd
(kernels: Rust on CPU, CUDA C++ on CUDA).
"""
