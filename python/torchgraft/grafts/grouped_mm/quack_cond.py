"""Which ``aten::_grouped_mm`` calls quack takes: the MoE experts' GEMMs, in bfloat16, on Hopper.

The cond runs on every call and reads metadata only. It takes exactly the three GEMMs autograd
runs for an expert projection, in the layouts they come in, and declines everything else, so
ATen runs it (and raises ATen's errors for bad input):

* forward and the first operand's gradient: ``mat_a`` 2-D ``(M, K)`` row-major, ``mat_b`` 3-D
  ``(groups, K, N)`` in either major, groups splitting M;
* the second operand's gradient: ``mat_a`` 2-D ``(M, K)`` column-major (a transposed view of
  the rows), ``mat_b`` 2-D ``(K, N)`` row-major, groups splitting K;
* int32 offsets, one per group; no bias; a bfloat16 result; CUDA sm_90 (what was measured:
  ``bench/results/grouped_mm_cuda-h200.md``);
* every size nonzero, no broadcast (zero-stride) operand; data 16-byte aligned, leading strides
  multiples of 16 bytes (TMA); K and N multiples of 8 (N so the result is contiguous, as ATen
  lays it out).

Offsets are not read (that would wait for the GPU): decreasing offsets or offsets past M are
the caller's error, as in ATen's kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.device import device_capability

from .quack_impl import QUACK

__all__ = ["grouped_mm_cond", "why_not"]

_ALIGN = 8  # bfloat16 elements in 16 bytes


def _aligned(t: Tensor) -> bool:
    """16-byte aligned data and every stride other than the unit one a multiple of 16 bytes."""
    return t.data_ptr() % 16 == 0 and all(s % _ALIGN == 0 for s in t.stride() if s != 1)


def _layout_reason(mat_a: Tensor, mat_b: Tensor) -> str | None:
    if mat_a.dim() != 2 or mat_b.dim() not in (2, 3):
        return f"operands {mat_a.dim()}-D x {mat_b.dim()}-D (takes 2-D x 3-D and 2-D x 2-D)"
    k_a, k_b = mat_a.shape[1], mat_b.shape[-2]
    if k_a != k_b:
        return f"inner sizes differ ({k_a} and {k_b})"
    if min(mat_a.shape[0], k_a, mat_b.shape[-1]) == 0 or (mat_b.dim() == 3 and not mat_b.shape[0]):
        return "an empty operand"
    if 0 in mat_a.stride() or 0 in mat_b.stride():
        return "a broadcast (zero-stride) operand"
    if mat_b.shape[-1] % _ALIGN or k_a % _ALIGN:
        return f"K = {k_a} or N = {mat_b.shape[-1]} not a multiple of {_ALIGN}"
    if mat_b.dim() == 3:
        if mat_a.stride(1) != 1:
            return "mat_a not row-major"
        if mat_b.stride(-1) != 1 and mat_b.stride(-2) != 1:
            return "mat_b has no unit stride in its last two dimensions"
    elif mat_a.stride(0) != 1 or mat_b.stride(1) != 1:
        return "2-D x 2-D not laid out as autograd forms it (mat_a column-major, mat_b row-major)"
    if not (_aligned(mat_a) and _aligned(mat_b)):
        return "data or strides not 16-byte aligned"
    return None


def why_not(
    mat_a: Tensor,
    mat_b: Tensor,
    offs: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype | None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why quack should not run this call, or None when it should.

    ``capability`` None reads the device's ``(major, minor)`` from ``mat_a``'s GPU; given, the
    call is judged as if on a GPU of that capability (tests on CPU tensors).
    """
    if QUACK.failed:
        return f"quack could not be imported ({QUACK.error})"
    if offs is None:
        return "no offsets"
    if bias is not None:
        return "a bias"
    if mat_a.dtype != torch.bfloat16 or mat_b.dtype != torch.bfloat16:
        return f"dtypes {mat_a.dtype} x {mat_b.dtype} (takes bfloat16)"
    if out_dtype not in (None, torch.bfloat16):
        return f"out_dtype {out_dtype}"
    if offs.dtype != torch.int32 or offs.dim() != 1:
        return f"offsets {offs.dtype} {offs.dim()}-D (takes int32 1-D)"
    if not (mat_a.device == mat_b.device == offs.device):
        return "operands on different devices"
    reason = _layout_reason(mat_a, mat_b)
    if reason is not None:
        return reason
    groups = offs.shape[0]
    if mat_b.dim() == 3 and groups != mat_b.shape[0]:
        return f"{groups} offsets for {mat_b.shape[0]} groups"
    if mat_b.dim() == 2 and not groups:
        return "no groups"
    if capability is None:
        if mat_a.device.type != "cuda":
            return f"device {mat_a.device.type}"
        capability = device_capability(mat_a.device.index or 0)
    if capability[0] != 9:
        return f"sm{capability[0]}{capability[1]} (measured on sm90 only)"
    return None


def grouped_mm_cond(
    mat_a: Tensor,
    mat_b: Tensor,
    offs: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> bool:
    """True when quack should compute this ``aten::_grouped_mm``."""
    return why_not(mat_a, mat_b, offs, bias, out_dtype) is None
