"""The lm head's matmul and the cross-entropy fused by chunks of rows (the logits never exist).

``reference`` holds the float64 reference; ``fake`` and ``autograd`` give
``torch.ops.torchgraft.linear_cross_entropy`` its fake functions and autograd (orchestration in
Rust: aten matmuls, cuBLAS on CUDA, and the cross-entropy row kernels). ``registration`` serves
torch's ``F.linear_cross_entropy`` with it, through the registry.
"""
