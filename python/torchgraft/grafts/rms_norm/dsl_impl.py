"""quack's CuteDSL RMSNorm, the Helion RMSNorm and the cuTile RMSNorm as implementations of
``aten::_fused_rms_norm`` and its backward, returning what ATen returns.

Both kernel libraries allocate their own 2-D outputs; these impls hand them rows and reshape
the results to ATen's: ``y`` like the input, ``rstd`` float32 shaped like the batch dims plus
a 1 per normalized dim, ``dx`` like the input and ``dw`` like the weight (None where
``output_mask`` says so). The kernel modules are imported on the first call; if that import
fails the impl calls the op again, which reaches the kernel below, and the conds decline from
then on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchgraft.common.device import on_device_of
from torchgraft.dsl.lazy import LazyKernels

from .reference import default_eps
from .shapes import rows_and_hidden, rstd_shape

__all__ = [
    "CUTILE",
    "HELION",
    "QUACK",
    "cutile_backward_impl",
    "cutile_forward_impl",
    "helion_backward_impl",
    "helion_forward_impl",
    "quack_backward_impl",
    "quack_forward_impl",
]

#: quack's kernels (CuteDSL), imported on first use.
QUACK = LazyKernels("torchgraft.grafts.rms_norm.quack_kernels")
#: The Helion kernels, imported on first use.
HELION = LazyKernels("torchgraft.grafts.rms_norm.helion_kernels")
#: The cuTile kernels, imported on first use.
CUTILE = LazyKernels("torchgraft.grafts.rms_norm.cutile_kernels")

_aten = torch.ops.aten


def _forward(
    kernels: LazyKernels,
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    eps: float | None,
) -> tuple[Tensor, Tensor]:
    loaded = kernels.get()
    if loaded is None:
        return _aten._fused_rms_norm.default(input, normalized_shape, weight, eps)
    n_rows, n_cols = rows_and_hidden(input, normalized_shape)
    x = input.contiguous().view(n_rows, n_cols)
    w = weight.contiguous().view(n_cols) if weight is not None else None
    with on_device_of(input):
        y, rstd = loaded.forward(x, w, default_eps(input.dtype) if eps is None else eps)
    return y.view(input.shape), rstd.view(rstd_shape(input, normalized_shape))


def _backward(
    kernels: LazyKernels,
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[Tensor | None, Tensor | None]:
    loaded = kernels.get()
    if loaded is None:
        return _aten._fused_rms_norm_backward.default(
            grad_out, input, normalized_shape, rstd, weight, output_mask
        )
    n_rows, n_cols = rows_and_hidden(input, normalized_shape)
    with on_device_of(input):
        dx, dw = loaded.backward(
            grad_out.contiguous().view(n_rows, n_cols),
            input.contiguous().view(n_rows, n_cols),
            rstd.contiguous().view(n_rows),
            weight.contiguous().view(n_cols) if weight is not None else None,
        )
    dx_out = dx.view(input.shape) if output_mask[0] else None
    dw_out = dw.view(weight.shape) if output_mask[1] and weight is not None else None
    return dx_out, dw_out


def quack_forward_impl(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    """``aten::_fused_rms_norm`` through quack's CuteDSL kernel: ``(y, rstd)``."""
    return _forward(QUACK, input, normalized_shape, weight, eps)


def quack_backward_impl(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``aten::_fused_rms_norm_backward`` through quack's CuteDSL kernel: ``(dx, dw)``."""
    return _backward(QUACK, grad_out, input, normalized_shape, rstd, weight, output_mask)


def helion_forward_impl(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    """``aten::_fused_rms_norm`` through the Helion kernel (a weight is required)."""
    return _forward(HELION, input, normalized_shape, weight, eps)


def helion_backward_impl(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``aten::_fused_rms_norm_backward`` through the Helion kernels (a weight is required)."""
    return _backward(HELION, grad_out, input, normalized_shape, rstd, weight, output_mask)


def cutile_forward_impl(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> tuple[Tensor, Tensor]:
    """``aten::_fused_rms_norm`` through the cuTile kernel (a weight is required)."""
    return _forward(CUTILE, input, normalized_shape, weight, eps)


def cutile_backward_impl(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``aten::_fused_rms_norm_backward`` through the cuTile kernels (a weight is required)."""
    return _backward(CUTILE, grad_out, input, normalized_shape, rstd, weight, output_mask)
