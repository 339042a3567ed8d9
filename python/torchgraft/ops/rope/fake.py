"""Fake functions of ``torchgraft::rope`` and ``torchgraft::rope_backward``.

The schemas and kernels are native (crates/graft-native/src/ops/rope/); importing this module
defines them and registers the fake functions (shapes and strides for ``torch.compile``, with the
kernels' checks). The autograd formula is :mod:`.autograd`'s: the gradients of ``q`` and ``k``
come from the fused ``rope_backward`` op; ``cos`` and ``sin`` (which models compute without
gradient) get theirs from the eager formula, only when they require it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.define import define_ops

__all__: list[str] = []

define_ops()


def _is_dense(x: Tensor) -> bool:
    """Whether ``x``'s elements fill ``numel`` consecutive slots in some dimension order."""
    if x.numel() == 0:
        return True
    expected = 1
    dims = sorted((st, sz) for st, sz in zip(x.stride(), x.shape, strict=True) if sz != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _output_like(x: Tensor) -> Tensor:
    """The output the kernels allocate for input ``x``: ``x``'s strides when ``x`` is dense with
    contiguous rows (what eager's elementwise ops give), else contiguous."""
    rows_contiguous = x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1
    if rows_contiguous and _is_dense(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _grad_output_like(g: Tensor, cos: Tensor, unsqueeze_dim: int) -> Tensor:
    """The output the backward kernels allocate for output gradient ``g``: dense with the heads
    (the dimension ``unsqueeze_dim`` broadcasts the tables over) innermost before the last, the
    layout of the ``(batch, seq, heads * dim)`` projections q and k are views of, so the
    gradients reach them with no copy (SDPA's backward gives ``g`` contiguous instead)."""
    table_rank = cos.dim() + 1
    at = unsqueeze_dim + table_rank if unsqueeze_dim < 0 else unsqueeze_dim
    heads = g.dim() + at - table_rank
    if not 0 <= heads < g.dim() - 1:
        return _output_like(g)
    order = [i for i in range(g.dim() - 1) if i != heads] + [heads, g.dim() - 1]
    strides: list[Any] = [0] * g.dim()
    step: Any = 1
    for i in reversed(order):
        strides[i] = step
        step = step * torch.sym_max(g.shape[i], 1)
    return torch.empty_strided(g.shape, strides, dtype=g.dtype, device=g.device)


def _check(
    op: str,
    names: tuple[str, str],
    x: tuple[Tensor, Tensor],
    cos: Tensor,
    sin: Tensor,
    unsqueeze_dim: int,
) -> None:
    """The native kernels' checks (``ops/rope.rs``), for fake tensors (same messages)."""
    (
        Operands(op)
        .tensor(names[0], x[0])
        .float()
        .tensor(names[1], x[1])
        .dtype_like(names[0])
        .tensor("cos", cos)
        .dtype_like(names[0])
        .tensor("sin", sin)
        .dtype_like(names[0])
        .check()
    )
    if sin.shape != cos.shape:
        raise RuntimeError(
            f"{op}: expected sin of size {list(cos.shape)} (the size of cos), got {list(sin.shape)}"
        )
    rank = cos.dim()
    if not -rank - 1 <= unsqueeze_dim <= rank:
        raise RuntimeError(
            f"Dimension out of range (expected to be in range of [{-rank - 1}, {rank}], but got "
            f"{unsqueeze_dim})"
        )
    if rank < 1:
        raise RuntimeError(f"{op}: cos and sin must have at least one dimension")
    table = list(cos.unsqueeze(unsqueeze_dim).shape)
    rotary = table[-1]
    if rotary % 2:
        raise RuntimeError(
            f"{op}: the rotary dimension (the last size of cos, unsqueezed: {table}) must be even, "
            f"got {rotary}"
        )
    for name, t in zip(names, x, strict=True):
        if t.dim() < 1:
            raise RuntimeError(f"{op}: {name} must have at least one dimension")
        if rotary > t.shape[-1]:
            raise RuntimeError(
                f"{op}: the rotary dimension {rotary} (the last size of cos) exceeds {name}'s head "
                f"dimension {t.shape[-1]}"
            )
        lead, table_lead = list(t.shape[:-1]), table[:-1]
        ok = len(table_lead) <= len(lead) and all(
            c == 1 or (c == s and s != 1)
            for c, s in zip(reversed(table_lead), reversed(lead), strict=False)
        )
        if not ok:
            raise RuntimeError(
                f"{op}: cos and sin (unsqueezed: {table}) must broadcast to {name}'s size "
                f"{list(t.shape)} without expanding it"
            )


@torch.library.register_fake("torchgraft::rope")
def _rope_fake(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    _check("rope", ("q", "k"), (q, k), cos, sin, unsqueeze_dim)
    return _output_like(q), _output_like(k)


@torch.library.register_fake("torchgraft::rope_backward")
def _rope_backward_fake(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    _check("rope_backward", ("grad_q", "grad_k"), (grad_q, grad_k), cos, sin, unsqueeze_dim)
    return (
        _grad_output_like(grad_q, cos, unsqueeze_dim),
        _grad_output_like(grad_k, cos, unsqueeze_dim),
    )
