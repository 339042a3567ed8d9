"""quack's grouped GEMMs (quack-kernels, module ``quack``): varlen-M and varlen-K.

Importing this module imports quack and with it CuteDSL; the impl imports it on its first call,
never at registration. quack compiles a kernel per (dtype, operand majors, varlen kind) the
first time it meets one (1-2 s each on the H200), whatever the sizes.

``gemm(..., tuned=False)`` runs quack's default configuration for the GPU (on Hopper a 128 x 192
tile, ping-pong warpgroups, clusters of 2 along M): the fastest of the four tried at the MoE
yardstick's shapes in 10 of 12 GEMMs (``bench/results/grouped_mm_cuda-h200.md``). No autotuning:
it would time every configuration on the first call of each shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quack.gemm_interface import gemm
from torch import Tensor

__all__ = ["grouped_mm"]


def grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)`` for a 2-D ``mat_a`` in bfloat16.

    A 3-D ``mat_b`` ``(groups, K, N)``: groups of ``mat_a``'s rows, ``(M, N)`` (rows past the
    last offset are not written, as in ATen). A 2-D ``mat_b`` ``(K, N)``: groups of the shared
    dimension, ``(groups, M, N)`` (an empty group's product written as zeros).
    """
    starts = F.pad(offs, (1, 0))  # quack's cu_seqlens: a leading zero, then the ends
    if mat_b.dim() == 3:
        out = torch.empty(mat_a.shape[0], mat_b.shape[-1], device=mat_a.device, dtype=mat_a.dtype)
        gemm(mat_a, mat_b, out=out, cu_seqlens_m=starts, tuned=False)
    else:
        out = torch.empty(
            offs.shape[0], mat_a.shape[0], mat_b.shape[-1], device=mat_a.device, dtype=mat_a.dtype
        )
        gemm(mat_a, mat_b, out=out, cu_seqlens_k=starts, tuned=False)
    return out
