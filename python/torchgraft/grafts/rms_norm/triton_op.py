"""The Triton RMSNorm as custom operators (``torch.library.triton_op``) with autograd.

``torchgraft::rms_norm_triton_fwd`` and ``torchgraft::rms_norm_triton_bwd`` run the same
kernels as the aten graft. Because they are ``triton_op``s, ``torch.compile`` traces into them
(no graph break) and Inductor sees the Triton kernels themselves. :func:`rms_norm` is the
user-facing function, differentiable in ``x`` and ``weight``.

Defining a ``triton_op`` imports triton, so this module is imported lazily by the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .shapes import check_weight_shape, empty_rstd, rows_and_hidden
from .triton_impl import fused_rms_norm_backward_impl, fused_rms_norm_impl

__all__ = ["rms_norm", "rms_norm_triton_bwd", "rms_norm_triton_fwd"]


def _traceable(kernel: Any) -> Any:
    """``wrap_triton`` for compiled kernels.

    Under TRITON_INTERPRET=1 the kernels are interpreted functions, which torch 2.11's
    ``wrap_triton`` refuses; they are launched as they are (eager only).
    """
    if type(kernel).__name__ == "InterpretedFunction":
        return kernel
    return wrap_triton(kernel)


def _check_weight(x: Tensor, weight: Tensor | None, normalized_shape: Sequence[int]) -> None:
    check_weight_shape(weight, normalized_shape)
    if weight is not None and weight.dtype != x.dtype:
        raise RuntimeError(f"weight dtype {weight.dtype} differs from input dtype {x.dtype}")


@triton_op("torchgraft::rms_norm_triton_fwd", mutates_args=())
def rms_norm_triton_fwd(
    x: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    """RMSNorm forward: ``(y, rstd)`` with aten's ``_fused_rms_norm`` shapes and dtypes."""
    _check_weight(x, weight, normalized_shape)
    return fused_rms_norm_impl(x, normalized_shape, weight, eps, wrap=_traceable)


@triton_op("torchgraft::rms_norm_triton_bwd", mutates_args=())
def rms_norm_triton_bwd(
    grad_out: Tensor,
    x: Tensor,
    normalized_shape: list[int],
    rstd: Tensor,
    weight: Tensor | None,
    compute_dx: bool,
    compute_dw: bool,
) -> tuple[Tensor, Tensor]:
    """RMSNorm backward: ``(dx, dw)``; a skipped gradient comes back as an empty tensor."""
    mask = [compute_dx, compute_dw]
    dx, dw = fused_rms_norm_backward_impl(
        grad_out, x, normalized_shape, rstd, weight, mask, wrap=_traceable
    )
    return (
        dx if dx is not None else x.new_empty(0),
        dw if dw is not None else x.new_empty(0),
    )


@rms_norm_triton_fwd.register_fake
def _fwd_fake(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    rows_and_hidden(x, normalized_shape)
    _check_weight(x, weight, normalized_shape)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, empty_rstd(x, normalized_shape)


@rms_norm_triton_bwd.register_fake
def _bwd_fake(
    grad_out: Tensor,
    x: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    compute_dx: bool,
    compute_dw: bool,
) -> tuple[Tensor, Tensor]:
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if compute_dx else None
    dw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if compute_dw and weight is not None
        else None
    )
    return (
        dx if dx is not None else x.new_empty(0),
        dw if dw is not None else x.new_empty(0),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, normalized_shape, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, rstd, weight)
    ctx.normalized_shape = normalized_shape
    ctx.mark_non_differentiable(rstd)
    # rstd is never differentiated: no zero-filled gradient for it (one op less per backward).
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_y: Tensor | None, _grad_rstd: Tensor | None) -> tuple[Any, ...]:
    if grad_y is None:  # an undefined upstream gradient: no gradient flows
        return None, None, None, None
    x, rstd, weight = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    need_dw = weight is not None and ctx.needs_input_grad[2]
    dx, dw = rms_norm_triton_bwd(grad_y, x, ctx.normalized_shape, rstd, weight, need_dx, need_dw)
    return (dx if need_dx else None), None, (dw if need_dw else None), None


rms_norm_triton_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """RMSNorm through the Triton kernels, as ``torch.nn.functional.rms_norm`` computes it.

    ``y = x * rsqrt(mean(x**2) + eps) * weight`` over the trailing ``normalized_shape`` dims,
    computed in float32 (float64 for float64 input) and rounded to ``x.dtype``. ``eps=None``
    means float32's machine epsilon (float64's for float64 input). Differentiable in ``x``
    and ``weight``; traceable by ``torch.compile`` without graph breaks. ``weight`` must have
    ``x``'s dtype.
    """
    y, _ = rms_norm_triton_fwd(x, list(normalized_shape), weight, eps)
    return y
