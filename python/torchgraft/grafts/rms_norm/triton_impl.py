"""The Triton RMSNorm as implementations of ``aten::_fused_rms_norm`` and its backward.

Each impl allocates what aten returns (same shapes, dtypes and contiguity) and runs the
Triton kernels on it. Triton is imported on the first call, not when this module loads.
The impls expect inputs their cond accepted; they recheck only what would otherwise give a
wrong result silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .reference import default_eps
from .shapes import empty_rstd, rows_and_hidden

__all__ = ["fused_rms_norm_backward_impl", "fused_rms_norm_impl"]

_kernels: ModuleType | None = None


def _triton_kernels() -> ModuleType:
    """The kernels module, imported (with triton) on first use."""
    global _kernels
    if _kernels is None:
        from . import triton_kernels

        _kernels = triton_kernels
    return _kernels


def fused_rms_norm_impl(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    eps: float | None,
    *,
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """``aten::_fused_rms_norm`` through the Triton forward kernel: returns ``(y, rstd)``.

    ``wrap`` is applied to the kernel before launching (``torch.library.wrap_triton`` inside a
    ``triton_op``).
    """
    n_rows, n_cols = rows_and_hidden(input, normalized_shape)
    x = input.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = empty_rstd(x, normalized_shape)
    if n_rows == 0 or n_cols == 0:
        return y, rstd.fill_(float("nan") if n_cols == 0 else 0.0)
    w = weight.contiguous().view(n_cols) if weight is not None else None
    _triton_kernels().rms_norm_forward(
        x.view(n_rows, n_cols),
        w,
        default_eps(x.dtype) if eps is None else eps,
        y.view(n_rows, n_cols),
        rstd.view(n_rows),
        wrap=wrap,
    )
    return y, rstd


def fused_rms_norm_backward_impl(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
    *,
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``aten::_fused_rms_norm_backward`` through the Triton backward kernels.

    Returns ``(dx, dw)``: ``dx`` like ``input`` when ``output_mask[0]``, ``dw`` like
    ``weight`` when ``output_mask[1]`` and there is a weight, ``None`` otherwise. ``wrap`` as
    in :func:`fused_rms_norm_impl`.
    """
    n_rows, n_cols = rows_and_hidden(input, normalized_shape)
    x = input.contiguous()
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None
    dw = (
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if output_mask[1] and weight is not None
        else None
    )
    if n_rows == 0 or n_cols == 0:
        # aten's answer for empty input: zero gradients.
        return (dx.zero_() if dx is not None else None), (dw.zero_() if dw is not None else None)
    if rstd.numel() != n_rows:
        raise RuntimeError(f"rstd has {rstd.numel()} elements for {n_rows} normalized rows")
    _triton_kernels().rms_norm_backward(
        grad_out.contiguous().view(n_rows, n_cols),
        x.view(n_rows, n_cols),
        rstd.contiguous().view(n_rows),
        weight.contiguous().view(n_cols) if weight is not None else None,
        dx.view(n_rows, n_cols) if dx is not None else None,
        dw.view(n_cols) if dw is not None else None,
        wrap=wrap,
    )
    return dx, dw
