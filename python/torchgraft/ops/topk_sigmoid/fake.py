"""Fake functions of ``torchgraft::topk_sigmoid`` and its backward op.

The schemas and kernels are native (crates/graft-native/src/ops/topk_sigmoid/); importing this
module defines them and registers the fake functions (shapes for ``torch.compile``, with the
kernels' checks). Their autograd is :mod:`.autograd`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.define import define_ops

__all__ = ["check_grouping", "weights_dtype"]

define_ops()


def weights_dtype(logits: Tensor) -> torch.dtype:
    """The routing weights' (and the bias') dtype: float32, float64 for float64 logits."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def check_grouping(op: str, experts: int, k: int, groups: int, topk_groups: int) -> None:
    """The kernels' rules for the choice (RuntimeError, as the native checks raise)."""
    if groups < 1 or experts % groups or experts // groups < 2:
        raise RuntimeError(
            f"{op}: expected groups to split the {experts} experts into groups of at least 2, "
            f"got groups = {groups}"
        )
    if not 1 <= topk_groups <= groups:
        raise RuntimeError(
            f"{op}: expected 1 <= topk_groups <= groups = {groups}, got topk_groups = {topk_groups}"
        )
    candidates = topk_groups * (experts // groups)
    if not 1 <= k <= candidates:
        raise RuntimeError(
            f"{op}: selected index k out of range (k = {k}, experts in the kept groups = "
            f"{candidates})"
        )


@torch.library.register_fake("torchgraft::topk_sigmoid")
def _topk_sigmoid_fake(
    logits: Tensor,
    bias: Tensor | None,
    k: int,
    groups: int,
    topk_groups: int,
    renormalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    op = "topk_sigmoid"
    Operands(op).tensor("logits", logits).float().dims(2).check()
    rows, experts = logits.shape
    if bias is not None:
        (
            Operands(op)
            .tensor("logits", logits)
            .tensor("bias", bias)
            .dtype(weights_dtype(logits))
            .sizes((experts,))
            .check()
        )
    check_grouping(op, experts, k, groups, topk_groups)
    weights = logits.new_empty((rows, k), dtype=weights_dtype(logits))
    return weights, logits.new_empty((rows, k), dtype=torch.int64)


@torch.library.register_fake("torchgraft::topk_sigmoid_backward")
def _topk_sigmoid_backward_fake(
    grad_weights: Tensor, logits: Tensor, indices: Tensor, renormalize: bool, scale: float
) -> Tensor:
    op = "topk_sigmoid_backward"
    Operands(op).tensor("logits", logits).float().dims(2).check()
    rows, experts = logits.shape
    k = indices.shape[1] if indices.dim() == 2 else -1
    if indices.dim() != 2 or indices.shape[0] != rows or not 1 <= k <= experts:
        raise RuntimeError(
            f"{op}: expected indices of size [{rows}, k] with 1 <= k <= {experts}, "
            f"got {list(indices.shape)}"
        )
    (
        Operands(op)
        .tensor("logits", logits)
        .tensor("grad_weights", grad_weights)
        .dtype(weights_dtype(logits))
        .sizes(indices.shape)
        .tensor("indices", indices)
        .dtype(torch.int64)
        .check()
    )
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
