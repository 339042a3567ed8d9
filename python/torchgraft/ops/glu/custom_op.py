"""Autograd and fake functions of ``torchgraft::swiglu`` and ``torchgraft::geglu``.

The schemas and kernels are native (crates/graft-native/src/ops/glu/); importing this module
defines them and registers what only Python can give: the fake function (shapes for
``torch.compile``, with the kernels' checks) and the autograd formula, whose backward is the
fused ``*_backward`` op, or with ``inplace_backward=True`` the ``*_backward_`` op that writes the
gradients over ``gate`` and ``up`` (see ``torchgraft.functional.swiglu``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.ops.eager_autograd import register_autograd
from torchgraft.ops.native_ops import define_native_ops
from torchgraft.ops.operands import Operands

__all__ = ["geglu", "swiglu"]

define_native_ops()


def _check(
    op: str, gate: Tensor, up: Tensor, grad: Tensor | None = None, written: bool = False
) -> None:
    """The operands of the native kernels (``ops/glu.rs``'s ``check``, ``check_in_place`` when
    ``written``), for fake tensors."""
    (
        Operands(op)
        .tensor("gate", gate, written=written)
        .float()
        .tensor("up", up, written=written)
        .like("gate")
        .optional("grad", grad)
        .like("gate")
        .check()
    )


def _empty(like: Tensor) -> Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


@torch.library.register_fake("torchgraft::swiglu")
def _swiglu_fake(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    _check("swiglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::swiglu_backward")
def _swiglu_backward_fake(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    _check("swiglu_backward", gate, up, grad)
    return _empty(gate), _empty(up)


@torch.library.register_fake("torchgraft::geglu")
def _geglu_fake(gate: Tensor, up: Tensor, tanh: bool, *, inplace_backward: bool = False) -> Tensor:
    _check("geglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::geglu_backward")
def _geglu_backward_fake(
    grad: Tensor, gate: Tensor, up: Tensor, tanh: bool
) -> tuple[Tensor, Tensor]:
    _check("geglu_backward", gate, up, grad)
    return _empty(gate), _empty(up)


@torch.library.register_fake("torchgraft::swiglu_backward_")
def _swiglu_backward_inplace_fake(grad: Tensor, gate: Tensor, up: Tensor) -> None:
    _check("swiglu_backward_", gate, up, grad, written=True)


@torch.library.register_fake("torchgraft::geglu_backward_")
def _geglu_backward_inplace_fake(grad: Tensor, gate: Tensor, up: Tensor, tanh: bool) -> None:
    _check("geglu_backward_", gate, up, grad, written=True)


def _owned_intermediate(t: Tensor) -> bool:
    """Whether the in-place backward may write ``t``'s gradient over it: an intermediate result
    of a recorded op (not a leaf, whose ``.grad`` would become itself), contiguous (so the
    kernel writes it directly)."""
    return t.requires_grad and t.grad_fn is not None and t.is_contiguous()


def _save_inputs(
    ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any], output: Tensor
) -> None:
    gate, up = inputs[0], inputs[1]
    ctx.save_for_backward(gate, up)
    ctx.tanh = inputs[2] if len(inputs) > 2 else None
    ctx.inplace = (
        keyword_only_inputs.get("inplace_backward", False)
        and _owned_intermediate(gate)
        and _owned_intermediate(up)
    )


def _backward(ctx: Any, grad: Tensor, name: str, *extra: Any) -> tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    if not ctx.inplace:
        return getattr(torch.ops.torchgraft, f"{name}_backward")(grad, gate, up, *extra)
    getattr(torch.ops.torchgraft, f"{name}_backward_")(grad, gate, up, *extra)
    # Anything else that saved gate or up now fails its version check instead of reading
    # gradients as values.
    torch.autograd.graph.increment_version(gate)
    torch.autograd.graph.increment_version(up)
    return gate, up


def _swiglu_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    return _backward(ctx, grad, "swiglu")


def _geglu_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    dgate, dup = _backward(ctx, grad, "geglu", ctx.tanh)
    return dgate, dup, None


# The ops' autograd, and what torchgraft.functional calls: the same formulas, less host work.
swiglu = register_autograd(torch.ops.torchgraft.swiglu.default, _swiglu_grad, _save_inputs)
geglu = register_autograd(torch.ops.torchgraft.geglu.default, _geglu_grad, _save_inputs)
