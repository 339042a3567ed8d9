"""quack's grouped GEMMs (quack-kernels, module ``quack``): varlen-M and varlen-K.

Importing this module imports quack and with it CuteDSL; the impl imports it on its first call,
never at registration. quack compiles a kernel per (dtype, operand majors, varlen kind) the
first time it meets one (1-2 s each on the H200), whatever the sizes.

The GEMMs run quack's default configuration for the GPU (on Hopper a 128 x 192 tile, ping-pong
warpgroups, clusters of 2 along M): of the four tried at the MoE yardstick's shapes, the
fastest or within 4% of the fastest in every GEMM (``bench/results/grouped_mm_cuda-h200*.md``). No
autotuning: it would time every configuration on the first call of each shape. The call goes
to quack's GEMM runner with that configuration, which is what ``quack.gemm_interface.gemm(...,
tuned=False)`` runs for these operands, without its checks for the cases this graft never
passes (scaled formats, bias, split K): they cost the host 20 us or more a call (H200).
"""

from __future__ import annotations

import functools

import torch
from quack.gemm_config import default_config
from quack.gemm_interface import gemm_tuned
from torch import Tensor

__all__ = ["grouped_mm"]

# quack's GEMM runner under its autotuner: resolved here, so a quack without it fails the
# import (and the graft declines from then on) instead of a call.
_run = gemm_tuned.fn


@functools.cache
def _config(device_index: int) -> object:
    return default_config(torch.device("cuda", device_index))


def grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)`` for a 2-D ``mat_a`` in bfloat16.

    A 3-D ``mat_b`` ``(groups, K, N)``: groups of ``mat_a``'s rows, ``(M, N)`` (rows past the
    last offset are not written, as in ATen). A 2-D ``mat_b`` ``(K, N)``: groups of the shared
    dimension, ``(groups, M, N)`` (an empty group's product written as zeros).
    """
    # Padded on every call: a cache keyed on the offsets tensor would go stale when a CUDA graph's
    # replay rewrites it, which does not bump its version counter.
    starts = torch.nn.functional.pad(offs, (1, 0))
    config = _config(mat_a.device.index or 0)
    if mat_b.dim() == 3:
        out = mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])
        _run(mat_a, mat_b, out, cu_seqlens_m=starts, config=config)
    else:
        out = mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[-1])
        _run(mat_a, mat_b, out, cu_seqlens_k=starts, config=config)
    return out
