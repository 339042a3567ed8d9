"""Fake functions of ``torchgraft::topk_softmax`` and its backward op.

The schemas and kernels are native (crates/graft-native/src/ops/topk_softmax/); importing this
module defines them and registers the fake functions (shapes for ``torch.compile``, with the
kernels' checks). Their autograd is :mod:`.autograd`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.define import define_ops

__all__ = ["weights_dtype"]

define_ops()


def weights_dtype(logits: Tensor) -> torch.dtype:
    """The routing weights' dtype: float32, float64 for float64 logits."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_forward(logits: Tensor, k: int) -> None:
    Operands("topk_softmax").tensor("logits", logits).float().dims(2).check()
    experts = logits.shape[1]
    if not 1 <= k <= experts:
        raise RuntimeError(
            f"topk_softmax: selected index k out of range (k = {k}, experts = {experts})"
        )


@torch.library.register_fake("torchgraft::topk_softmax")
def _topk_softmax_fake(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    _check_forward(logits, k)
    rows = logits.shape[0]
    weights = logits.new_empty((rows, k), dtype=weights_dtype(logits))
    return weights, logits.new_empty((rows, k), dtype=torch.int64)


@torch.library.register_fake("torchgraft::topk_softmax_backward")
def _topk_softmax_backward_fake(
    grad_weights: Tensor, logits: Tensor, weights: Tensor, indices: Tensor, renormalize: bool
) -> Tensor:
    op = "topk_softmax_backward"
    Operands(op).tensor("logits", logits).float().dims(2).check()
    rows, experts = logits.shape
    k = weights.shape[1] if weights.dim() == 2 else -1
    if weights.dim() != 2 or weights.shape[0] != rows or not 1 <= k <= experts:
        raise RuntimeError(
            f"{op}: expected weights of size [{rows}, k] with 1 <= k <= {experts}, "
            f"got {list(weights.shape)}"
        )
    acc = weights_dtype(logits)
    (
        Operands(op)
        .tensor("logits", logits)
        .tensor("grad_weights", grad_weights)
        .dtype(acc)
        .sizes(weights.shape)
        .tensor("weights", weights)
        .dtype(acc)
        .sizes(weights.shape)
        .tensor("indices", indices)
        .dtype(torch.int64)
        .sizes(weights.shape)
        .check()
    )
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
