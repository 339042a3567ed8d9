"""The lm head's matmul and the cross-entropy fused by chunks of rows (the logits never exist).

``reference`` holds the float64 reference; ``custom_op`` gives
``torch.ops.torchgraft.linear_cross_entropy`` its fake functions and autograd (orchestration in
Rust: aten matmuls, cuBLAS on CUDA, and the cross-entropy row kernels).
"""
