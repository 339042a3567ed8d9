"""Fake functions of ``torchgraft::moe_sort``, ``moe_permute``, ``moe_unpermute`` and its
backward op.

The schemas and kernels are native (crates/graft-native/src/ops/moe_permute/); importing this
module defines them and registers the fake functions (shapes for ``torch.compile``, with the
kernels' checks in the same order and words). Their autograd is :mod:`.autograd`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import Operands, c10_name
from torchgraft.ops.define import define_ops

__all__: list[str] = []

define_ops()

_VALID_DTYPES = (torch.int32, torch.int64)


def _check_valid_and_top_k(op: str, valid: Tensor, top_k: int) -> None:
    if valid.dtype not in _VALID_DTYPES:
        raise RuntimeError(
            f"{op}: expected valid to have dtype Int or Long, got {c10_name(valid.dtype)}"
        )
    if top_k < 1:
        raise RuntimeError(f"{op}: top_k must be at least 1, got {top_k}")


def check_sort(expert_ids: Tensor, num_experts: int) -> None:
    """``moe_sort``'s operands (its Rust entry's ``check_sort``)."""
    op = "moe_sort"
    Operands(op).tensor("expert_ids", expert_ids).dtype(torch.int64).check()
    if num_experts < 1:
        raise RuntimeError(f"{op}: num_experts must be at least 1, got {num_experts}")
    if expert_ids.numel() > 2**31 - 1:
        raise RuntimeError(
            f"{op}: {expert_ids.numel()} expert ids are too many: the offsets are int32"
        )


def check_permute(hidden: Tensor, perm: Tensor, valid: Tensor, top_k: int) -> None:
    """``moe_permute``'s operands (its Rust entry's ``check_permute``)."""
    op = "moe_permute"
    (
        Operands(op)
        .tensor("hidden", hidden)
        .float()
        .dims(2)
        .tensor("perm", perm)
        .dtype(torch.int64)
        .dims(1)
        .tensor("valid", valid)
        .numel(1)
        .check()
    )
    _check_valid_and_top_k(op, valid, top_k)
    pairs = hidden.shape[0] * top_k
    if perm.shape[0] != pairs:
        raise RuntimeError(
            f"{op}: expected perm of size [{pairs}] (tokens * top_k), got [{perm.shape[0]}]"
        )


def check_unpermute(
    op: str,
    grad: Tensor | None,
    y: Tensor,
    perm: Tensor | None,
    inv_perm: Tensor,
    valid: Tensor,
    weights: Tensor | None,
    top_k: int,
) -> None:
    """The operands of ``moe_unpermute`` and its backward (the Rust entries'
    ``check_unpermute``)."""
    first = Operands(op)
    if grad is not None:
        first.tensor("grad", grad).float().dims(2)
    first.tensor("y", y).float().dims(2)
    if grad is not None:
        first.dtype_like("grad")
    (
        first.optional("perm", perm)
        .dtype(torch.int64)
        .dims(1)
        .tensor("inv_perm", inv_perm)
        .dtype(torch.int64)
        .dims(1)
        .tensor("valid", valid)
        .numel(1)
        .optional("weights", weights)
        .float()
        .dims(2)
        .check()
    )
    _check_valid_and_top_k(op, valid, top_k)
    pairs, width = y.shape
    if pairs % top_k != 0:
        raise RuntimeError(
            f"{op}: expected the rows of y ({pairs}) to be a multiple of top_k ({top_k})"
        )
    tokens = pairs // top_k
    sizes = Operands(op)
    if grad is not None:
        sizes.tensor("grad", grad).sizes([tokens, width])
    (
        sizes.optional("perm", perm)
        .sizes([pairs])
        .tensor("inv_perm", inv_perm)
        .sizes([pairs])
        .optional("weights", weights)
        .sizes([tokens, top_k])
        .check()
    )


@torch.library.register_fake("torchgraft::moe_sort")
def _moe_sort_fake(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    check_sort(expert_ids, num_experts)
    pairs = expert_ids.numel()
    perm = expert_ids.new_empty((pairs,))
    return (
        perm,
        expert_ids.new_empty((pairs,)),
        expert_ids.new_empty((num_experts,), dtype=torch.int32),
    )


@torch.library.register_fake("torchgraft::moe_permute")
def _moe_permute_fake(hidden: Tensor, perm: Tensor, valid: Tensor, top_k: int) -> Tensor:
    check_permute(hidden, perm, valid, top_k)
    return hidden.new_empty((perm.shape[0], hidden.shape[1]))


@torch.library.register_fake("torchgraft::moe_unpermute")
def _moe_unpermute_fake(
    y: Tensor, inv_perm: Tensor, valid: Tensor, weights: Tensor | None, top_k: int
) -> Tensor:
    check_unpermute("moe_unpermute", None, y, None, inv_perm, valid, weights, top_k)
    return y.new_empty((y.shape[0] // top_k, y.shape[1]))


@torch.library.register_fake("torchgraft::moe_unpermute_backward")
def _moe_unpermute_backward_fake(
    grad: Tensor,
    y: Tensor,
    perm: Tensor,
    inv_perm: Tensor,
    valid: Tensor,
    weights: Tensor | None,
    top_k: int,
) -> tuple[Tensor, Tensor]:
    check_unpermute("moe_unpermute_backward", grad, y, perm, inv_perm, valid, weights, top_k)
    dy = y.new_empty(y.shape)
    if weights is None:
        return dy, y.new_empty((0,))
    return dy, weights.new_empty((y.shape[0] // top_k, top_k))
