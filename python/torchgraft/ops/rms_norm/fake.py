"""Fake functions of ``torchgraft::rms_norm`` and ``torchgraft::rms_norm_backward``.

The schemas and kernels are native (crates/graft-native/src/ops/rms_norm/); importing this
module defines them and registers the fake functions (shapes for ``torch.compile``, with the
kernels' checks and messages). The autograd formula is :mod:`.autograd`'s, whose backward is the
fused ``rms_norm_backward`` op (dx and dw in one kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.operands import Operands, c10_name
from torchgraft.ops.define import define_ops

from .reference import acc_dtype

__all__ = ["check"]

define_ops()


def check(
    op: str,
    x: Tensor,
    weight: Tensor | None,
    cast_before_weight: bool,
    saved: tuple[Tensor, Tensor] | None = None,
) -> None:
    """The native kernels' checks (``ops/rms_norm.rs``'s ``check``), for fake tensors; ``saved``
    is the backward's ``(grad, rstd)``."""
    if x.dim() == 0:
        raise RuntimeError(
            f"{op}: expected an input with at least 1 dimension (normalized over the last), "
            "got a 0-dim tensor"
        )
    grad, rstd = saved if saved is not None else (None, None)
    rows = _prod(x.shape[:-1])
    (
        Operands(op)
        .tensor("x", x)
        .float()
        .optional("weight", weight)
        .float()
        .sizes([x.shape[-1]])
        .message(
            "Expected weight to be of same shape as normalized_shape, but got weight of shape "
            "{got} and normalized_shape = {want}"
        )
        .optional("grad", grad)
        .float()
        .sizes_like("x")
        .message("{op}: grad of size {got} does not match input of size {want}")
        .optional("rstd", rstd)
        .float()
        .numel(rows)
        .message("{op}: rstd has {got} elements, expected one per normalized row ({want})")
        .check()
    )
    if (
        weight is not None
        and cast_before_weight
        and torch.promote_types(x.dtype, weight.dtype) != x.dtype
    ):
        xd, wd = c10_name(x.dtype), c10_name(weight.dtype)
        raise RuntimeError(
            f"{op}: with cast_before_weight, a {wd} weight times a {xd} input is not {xd}; "
            "this op returns the input's dtype (torchgraft.functional.rms_norm computes this case)"
        )


def _prod(sizes: Any) -> Any:
    out = 1
    for s in sizes:
        out = out * s
    return out


@torch.library.register_fake("torchgraft::rms_norm")
def _rms_norm_fake(
    x: Tensor, weight: Tensor | None, eps: float, offset: float, cast_before_weight: bool
) -> tuple[Tensor, Tensor]:
    check("rms_norm", x, weight, cast_before_weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=acc_dtype(x.dtype), device=x.device)
    return y, rstd


@torch.library.register_fake("torchgraft::rms_norm_backward")
def _rms_norm_backward_fake(
    grad: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    offset: float,
    cast_before_weight: bool,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor]:
    check("rms_norm_backward", x, weight, cast_before_weight, (grad, rstd))
    dx_shape = x.shape if output_mask[0] else (0,)
    dx = torch.empty(dx_shape, dtype=x.dtype, device=x.device)
    dw_dtype = weight.dtype if weight is not None else x.dtype
    dw_shape = (x.shape[-1],) if output_mask[1] and weight is not None else (0,)
    dw = torch.empty(dw_shape, dtype=dw_dtype, device=x.device)
    return dx, dw
