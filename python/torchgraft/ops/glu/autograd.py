"""Autograd of ``torchgraft::swiglu`` and ``torchgraft::geglu``: the backward is the fused
``*_backward`` op, or with ``inplace_backward=True`` the ``*_backward_`` op that writes the
gradients over ``gate`` and ``up`` (see ``torchgraft.functional.swiglu``). Importing this module
defines the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.glu import fake  # noqa: F401  (defines the ops and their fake functions)

__all__ = ["geglu", "swiglu"]


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
