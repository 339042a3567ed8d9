"""torchgraft's fused operators as functions, differentiable and ``torch.compile``-able.

Each runs one ``torch.ops.torchgraft.*`` custom operator (Rust kernels on CPU, CUDA C++ on CUDA)
in place of a chain of aten ops that the dispatcher cannot fuse. Importing this module defines
those operators (it needs the compiled extension); it imports no DSL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.ops.glu import custom_op as _glu  # noqa: F401  (defines the ops' autograd)
from torchgraft.ops.model_rms_norm import custom_op as _rms_norm
from torchgraft.ops.model_rms_norm.reference import acc_dtype as _acc_dtype

__all__ = ["geglu", "rms_norm", "swiglu"]

_GELU_APPROXIMATIONS = ("none", "tanh")


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` in one pass (computed in float32, float64 for float64 inputs).

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
    """
    return torch.ops.torchgraft.swiglu(gate, up)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass.

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as for ``F.gelu``.
    """
    if approximate not in _GELU_APPROXIMATIONS:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return torch.ops.torchgraft.geglu(gate, up, approximate == "tanh")


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension with a model's own numerics, in one kernel each way.

    With ``xhat = x * rsqrt(mean(x^2) + eps)`` computed in float32 (float64 for float64 ``x``)
    and ``scale = offset + weight`` (added in float32, or float64 where ``x`` or the result is
    float64):

    - ``cast_before_weight=True``, as Llama, Mistral, Qwen and most transformers models write
      ``weight * xhat.to(x.dtype)``: ``xhat`` is rounded to ``x``'s dtype, then multiplied by
      ``scale`` and rounded to the dtype that expression returns (``x``'s, or a wider weight's:
      a float32 weight under a bfloat16 ``x`` gives float32, computed then as a normalization
      kernel and a multiply);
    - ``cast_before_weight=False``, as Gemma (``offset=1``: ``(xhat * (1 + weight.float()))``)
      and OLMo2 (``(weight * xhat)``) write it before ``.to(x.dtype)``: ``xhat * scale`` is
      rounded once to ``x``'s dtype; with a weight of ``x``'s dtype and ``offset=0`` this is
      ``F.rms_norm(x, [x.shape[-1]], weight, eps)``;
    - without a weight: ``xhat`` rounded to ``x``'s dtype (``offset`` must be 0).

    The backward computes dx and dw together (dw in the weight's dtype, summed in float32 in
    a fixed order: the same bits every run), taking the rounding's derivative as 1, as autograd
    does for ``.to()``: dw sums ``dy * xhat.to(x.dtype)`` where the forward rounded first.

    Args:
        x: The input, normalized over its last dimension; float16, bfloat16, float32 or
            float64, any shape with at least one dimension.
        weight: 1-D, ``x.shape[-1]`` elements, a floating dtype, on ``x``'s device; or None.
        eps: Added to the mean square; None: the machine epsilon of the accumulation dtype
            (as ``F.rms_norm``).
        offset: Added to the weight (Gemma: 1.0).
        cast_before_weight: Round ``xhat`` to ``x``'s dtype before the weight multiply.
    """
    if eps is None:
        eps = torch.finfo(_acc_dtype(x.dtype)).eps
    if weight is None:
        if offset != 0:
            raise ValueError(f"rms_norm: offset={offset} needs a weight (offset + weight)")
        return torch.ops.torchgraft.rms_norm(x, None, eps, 0.0, False)[0]
    if cast_before_weight and weight.dtype.is_floating_point and x.dtype.is_floating_point:
        out = torch.promote_types(x.dtype, weight.dtype)
        if out != x.dtype:
            # The product is wider than x: normalize in one kernel, multiply in the wider dtype.
            _rms_norm.check("rms_norm", x, weight, cast_before_weight=False)
            xhat = torch.ops.torchgraft.rms_norm(x, None, eps, 0.0, False)[0]
            scale = weight.to(out) + offset if offset != 0 else weight.to(out)
            return xhat.to(out) * scale
    return torch.ops.torchgraft.rms_norm(x, weight, eps, offset, cast_before_weight)[0]
