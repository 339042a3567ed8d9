"""Pure-PyTorch RMSNorm: the reference every RMSNorm kernel is tested against, and the eager
versions the benchmarks compare with.

The reference follows aten's ``_fused_rms_norm`` and ``_fused_rms_norm_backward`` (see
``torch/_decomp/decompositions.py``). By default it computes in float64 and returns float64
results, unrounded, so a kernel's error can be measured; ``compute_dtype=None`` reproduces
PyTorch's own dtypes instead (computation in float32 for half types, ``y`` cast back to the
input's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .shapes import check_weight_shape, rows_and_hidden

__all__ = [
    "default_eps",
    "rms_norm_backward_reference",
    "rms_norm_eager_same_dtype",
    "rms_norm_eager_upcast",
    "rms_norm_reference",
]


def default_eps(dtype: torch.dtype) -> float:
    """The eps aten uses when the caller passes ``eps=None``.

    aten takes it from the computation dtype: float32's epsilon for float16, bfloat16 and
    float32 inputs, float64's for float64 inputs.
    """
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Same mapping as torch._prims_common.get_computation_dtype for real floating types.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _normalized_dims(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None
) -> tuple[int, ...]:
    """The dims that are normalized over; raises aten's kind of error on a shape mismatch."""
    rows_and_hidden(x, normalized_shape)
    check_weight_shape(weight, normalized_shape)
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def rms_norm_reference(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[Tensor, Tensor]:
    """RMSNorm forward: ``y = x * rsqrt(mean(x**2) + eps) * weight`` over the trailing dims.

    Args:
        x: input, any floating dtype and device.
        normalized_shape: the trailing dims of ``x`` to normalize over.
        weight: optional scale shaped ``normalized_shape``.
        eps: added to the mean square; ``None`` means :func:`default_eps` of ``x.dtype``.
        compute_dtype: dtype to compute in; ``y`` and ``rstd`` are returned in it, unrounded.
            ``None`` reproduces aten: computation dtype float32 for half types, ``y`` cast
            back to ``x.dtype``, ``rstd`` in the computation dtype.

    Returns:
        ``(y, rstd)``: ``y`` shaped like ``x``; ``rstd`` shaped like the batch dims of ``x``
        followed by ``len(normalized_shape)`` ones. Both contiguous.
    """
    dims = _normalized_dims(x, normalized_shape, weight)
    acc = _computation_dtype(x.dtype) if compute_dtype is None else compute_dtype
    eps_value = default_eps(x.dtype) if eps is None else eps
    xc = x.to(acc)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + eps_value)
    y = xc * rstd
    if weight is not None:
        y = y * weight.to(acc)
    if compute_dtype is None:
        y = y.to(x.dtype)
    return y.contiguous(), rstd.contiguous()


def rms_norm_backward_reference(
    grad_out: Tensor,
    x: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool] = (True, True),
    *,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[Tensor | None, Tensor | None]:
    """RMSNorm backward, the gradients of :func:`rms_norm_reference`'s ``y``.

    With ``xhat = x * rstd`` and ``g = grad_out * weight`` (``grad_out`` without weight):
    ``dx = (g - xhat * mean(g * xhat)) * rstd`` and ``dw = sum over batch of grad_out * xhat``.

    Args:
        grad_out: gradient of ``y``, shaped like ``x``.
        x: the forward's input.
        normalized_shape: as in the forward.
        rstd: the forward's ``rstd`` (any shape with one value per normalized row).
        weight: the forward's weight or ``None``.
        output_mask: which of ``(dx, dw)`` to compute.
        compute_dtype: as in :func:`rms_norm_reference`; ``None`` returns both gradients in
            ``x.dtype`` as aten does.

    Returns:
        ``(dx, dw)``: ``dx`` shaped like ``x`` or ``None`` when ``output_mask[0]`` is false;
        ``dw`` shaped like ``weight``, or ``None`` when ``output_mask[1]`` is false or there is
        no weight.
    """
    dims = _normalized_dims(x, normalized_shape, weight)
    acc = _computation_dtype(x.dtype) if compute_dtype is None else compute_dtype
    batch_shape = list(x.shape[: x.dim() - len(dims)])
    xc = x.to(acc)
    g = grad_out.to(acc)
    r = rstd.to(acc).reshape(batch_shape + [1] * len(dims))
    xhat = xc * r
    gw = g * weight.to(acc) if weight is not None else g

    dx: Tensor | None = None
    if output_mask[0]:
        n = math.prod(normalized_shape)
        mean_gx = (gw * xhat).sum(dim=dims, keepdim=True) / n
        dx = ((gw - xhat * mean_gx) * r).contiguous()
    dw: Tensor | None = None
    if output_mask[1] and weight is not None:
        batch_dims = tuple(range(len(batch_shape)))
        dw = (g * xhat).sum(dim=batch_dims) if batch_dims else g * xhat
        dw = dw.contiguous()
    if compute_dtype is None:
        dx = dx.to(x.dtype) if dx is not None else None
        dw = dw.to(x.dtype) if dw is not None else None
    return dx, dw


def rms_norm_eager_upcast(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """Llama-style eager RMSNorm over the last dim: float32 math, cast back, then scale.

    ``x.float() * rsqrt(mean(x**2) + eps)``, cast to ``x.dtype``, times ``weight``.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf.to(x.dtype)
    return y * weight if weight is not None else y


def rms_norm_eager_same_dtype(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """Eager RMSNorm over the last dim with every op in ``x.dtype`` (pure bf16 for bf16)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y
