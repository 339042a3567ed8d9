"""Autograd of ``torchgraft::swiglu``, ``torchgraft::geglu`` and ``torchgraft::swiglu_packed``:
the backward is the fused ``*_backward`` op, or with ``inplace_backward=True`` the
``*_backward_`` op that writes the gradients over ``gate`` and ``up`` (over ``gate_up`` for the
packed op; see ``torchgraft.functional.swiglu``). Importing this module defines the ops and their
fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import autograd_caller, register_autograd
from torchgraft.ops.glu import fake  # noqa: F401  (defines the ops and their fake functions)

__all__ = ["geglu", "swiglu", "swiglu_packed", "swiglu_packed_inplace_backward"]


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


def _save_packed(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    (gate_up,) = inputs
    ctx.save_for_backward(gate_up)
    ctx.inplace = False


def _save_packed_owned(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    """As :func:`_save_packed`, for a caller that owns ``gate_up``: its backward writes the
    gradient over it when it is an intermediate (the schema has no flag for this, so the choice
    travels in the caller, not the op)."""
    (gate_up,) = inputs
    ctx.save_for_backward(gate_up)
    ctx.inplace = _owned_intermediate(gate_up)


def _swiglu_packed_grad(ctx: Any, grad: Tensor) -> Tensor:
    (gate_up,) = ctx.saved_tensors
    if not ctx.inplace:
        return torch.ops.torchgraft.swiglu_packed_backward(grad, gate_up)
    torch.ops.torchgraft.swiglu_packed_backward_(grad, gate_up)
    # As in _backward: anything else that saved gate_up now fails its version check.
    torch.autograd.graph.increment_version(gate_up)
    return gate_up


# The ops' autograd, and what torchgraft.functional calls: the same formulas, less host work.
swiglu = register_autograd(torch.ops.torchgraft.swiglu.default, _swiglu_grad, _save_inputs)
geglu = register_autograd(torch.ops.torchgraft.geglu.default, _geglu_grad, _save_inputs)
swiglu_packed = register_autograd(
    torch.ops.torchgraft.swiglu_packed.default, _swiglu_packed_grad, _save_packed
)
# The same op with the in-place backward (eager calls; under torch.compile and with tensor
# subclasses the op's registered formula runs, which allocates the gradient).
swiglu_packed_inplace_backward = autograd_caller(
    torch.ops.torchgraft.swiglu_packed.default, _save_packed_owned, _swiglu_packed_grad
)
