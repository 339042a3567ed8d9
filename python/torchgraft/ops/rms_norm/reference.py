"""What ``torchgraft.functional.rms_norm`` computes, in plain PyTorch.

With ``xhat = x * rsqrt(mean(x^2) + eps)`` over the last dim (in float32; float64 for float64
``x``) and ``scale = offset + weight`` (added in that accumulation dtype):

- ``cast_before_weight=True`` (Llama): ``xhat.to(x.dtype) * scale``, in the dtype the eager
  ``weight * xhat.to(x.dtype)`` returns (the promotion of ``x``'s and the weight's dtypes);
- ``cast_before_weight=False`` (Gemma, OLMo2): ``(xhat * scale).to(x.dtype)``;
- no weight: ``xhat.to(x.dtype)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["acc_dtype", "result_dtype", "rms_norm_eager", "rms_norm_reference"]


def acc_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype rstd and ``xhat`` are computed in: float64 for float64, else float32."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def result_dtype(
    x_dtype: torch.dtype, weight_dtype: torch.dtype | None, cast_before_weight: bool
) -> torch.dtype:
    """The output's dtype: ``x``'s, or with ``cast_before_weight`` the promotion of ``x``'s and
    the weight's (a float32 weight times a bfloat16 ``xhat`` is float32, as in the model)."""
    if weight_dtype is None or not cast_before_weight:
        return x_dtype
    return torch.promote_types(x_dtype, weight_dtype)


def rms_norm_eager(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tensor:
    """The expression models write, op by op in eager PyTorch (the numerics to match)."""
    acc = acc_dtype(x.dtype)
    h = x.to(acc)
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xhat.to(x.dtype)
    out = result_dtype(x.dtype, weight.dtype, cast_before_weight)
    compute = torch.promote_types(acc, out)
    scale = weight.to(compute) + offset if offset != 0 else weight.to(compute)
    if cast_before_weight:
        return (xhat.to(x.dtype).to(compute) * scale).to(out)
    return (xhat.to(compute) * scale).to(x.dtype)


def rms_norm_reference(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tensor:
    """The exact value in float64 (no intermediate rounding), returned in float64.

    ``cast_before_weight`` only moves a rounding, so it does not change the exact value.
    """
    h = x.double()
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xhat
    return xhat * (weight.double() + offset)
