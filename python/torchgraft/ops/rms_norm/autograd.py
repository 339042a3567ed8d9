"""Autograd of ``torchgraft::rms_norm`` (its backward is ``rms_norm_backward``), and
:data:`rms_norm`, what ``torchgraft.functional.rms_norm`` calls. Importing this module defines
the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.rms_norm import fake  # noqa: F401  (defines the ops and their fake functions)

__all__ = ["rms_norm"]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _eps, offset, cast_before_weight = inputs
    _y, rstd = output
    ctx.save_for_backward(x, rstd, weight)
    ctx.offset = offset
    ctx.cast_before_weight = cast_before_weight
    ctx.mark_non_differentiable(rstd)
    # rstd is never differentiated: no zero-filled gradient for it (one op less per backward).
    ctx.set_materialize_grads(False)


def _backward(
    ctx: Any, grad: Tensor | None, _grad_rstd: Tensor | None
) -> tuple[Tensor | None, Tensor | None, None, None, None]:
    if grad is None:  # an undefined upstream gradient: no gradient flows
        return None, None, None, None, None
    x, rstd, weight = ctx.saved_tensors
    want_dx, want_dw = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
    dx, dw = torch.ops.torchgraft.rms_norm_backward(
        grad, x, rstd, weight, ctx.offset, ctx.cast_before_weight, [want_dx, want_dw]
    )
    return (dx if want_dx else None), (dw if want_dw else None), None, None, None


# The op's autograd, and what torchgraft.functional.rms_norm calls (less host work per call).
rms_norm = register_autograd(torch.ops.torchgraft.rms_norm.default, _backward, _setup_context)
