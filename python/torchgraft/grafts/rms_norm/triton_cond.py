"""Which ``aten::_fused_rms_norm`` / ``_fused_rms_norm_backward`` calls the Triton kernels take.

The conds run on every call, so they only read metadata. Anything they refuse falls through
to the kernel that was there before (aten's), which also raises aten's own errors for bad
input: a shape mismatch is refused here, never reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .triton_crossover import wins_backward, wins_forward

__all__ = [
    "backward_inputs_fit",
    "fused_rms_norm_backward_cond",
    "fused_rms_norm_cond",
    "problem_size",
]

_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_ON_ROCM = torch.version.hip is not None


def _is_cow(t: Tensor) -> bool:
    """Whether ``t`` is copy-on-write: reading its data pointer would materialize it, so such
    tensors are left to aten.

    torch 2.15 raises for tensors with Python dispatch (FakeTensor, when the compile path asks
    a cond; wrapper subclasses); they own no storage a kernel could materialize: not COW, as
    torch 2.11-2.14 answered.
    """
    try:
        return torch._C._is_cow_tensor(t)
    except RuntimeError as exc:
        if "Python tensor subclasses" in str(exc):
            return False
        raise


def problem_size(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None) -> int:
    """The hidden size when torchgraft's RMSNorm kernels (any DSL) can take ``x`` and
    ``weight``, else 0: CUDA, float32/16/bfloat16, contiguous, matching shapes."""
    if _ON_ROCM or x.device.type != "cuda" or x.dtype not in _DTYPES:
        return 0
    n_dims = len(normalized_shape)
    if n_dims == 0 or x.dim() < n_dims:
        return 0
    trailing = x.shape[x.dim() - n_dims :]
    if list(trailing) != list(normalized_shape):
        return 0
    if not x.is_contiguous() or x.numel() == 0 or _is_cow(x):
        return 0
    if weight is not None and (
        weight.dtype != x.dtype
        or weight.device != x.device
        or list(weight.shape) != list(normalized_shape)
        or not weight.is_contiguous()
        or _is_cow(weight)
    ):
        return 0
    return trailing.numel()


def fused_rms_norm_cond(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    eps: float | None,
) -> bool:
    """True when the Triton forward should run this ``aten::_fused_rms_norm`` call.

    CUDA (not ROCm); float32, float16 or bfloat16; contiguous, non-empty input whose trailing
    dims equal ``normalized_shape``; a weight of the input's dtype, device and shape, or none;
    and a size where the Triton kernel beats aten's (:mod:`.triton_crossover`).
    """
    n_cols = problem_size(input, normalized_shape, weight)
    return n_cols > 0 and wins_forward(input.dtype, n_cols, input.numel() // n_cols)


def fused_rms_norm_backward_cond(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> bool:
    """True when the Triton backward should run this ``aten::_fused_rms_norm_backward`` call.

    The forward's conditions on ``input`` and ``weight``, plus: ``grad_out`` contiguous with
    the input's shape, dtype and device; ``rstd`` a contiguous float32 tensor on that device
    with one value per row.
    """
    n_cols = problem_size(input, normalized_shape, weight)
    if n_cols == 0:
        return False
    n_rows = input.numel() // n_cols
    return backward_inputs_fit(grad_out, input, rstd, n_rows) and wins_backward(
        input.dtype, n_cols, n_rows
    )


def backward_inputs_fit(grad_out: Tensor, input: Tensor, rstd: Tensor, n_rows: int) -> bool:
    """Whether a backward's ``grad_out`` and ``rstd`` fit an ``input`` that
    :func:`problem_size` accepted: ``grad_out`` contiguous with the input's shape, dtype and
    device; ``rstd`` a contiguous float32 tensor on that device with one value per row."""
    if (
        grad_out.dtype != input.dtype
        or grad_out.device != input.device
        or grad_out.shape != input.shape
        or not grad_out.is_contiguous()
        or _is_cow(grad_out)
    ):
        return False
    return not (
        rstd.dtype != torch.float32
        or rstd.device != input.device
        or rstd.numel() != n_rows
        or not rstd.is_contiguous()
        or _is_cow(rstd)
    )
