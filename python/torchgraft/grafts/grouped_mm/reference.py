"""``torch._grouped_mm`` written as a loop over the groups, in float64 (tests compare with it)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grouped_mm_reference"]


def grouped_mm_reference(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """The grouped product in float64, for a 2-D ``mat_a`` with offsets.

    ``offs`` holds each group's end (cumulative, no leading zero). With a 3-D ``mat_b``
    ``(groups, K, N)`` the groups split ``mat_a``'s rows: ``(M, N)``, rows past the last offset
    zero. With a 2-D ``mat_b`` ``(K, N)`` they split the shared dimension K: ``(groups, M, N)``, an
    empty group's product zero.
    """
    a, b = mat_a.double(), mat_b.double()
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if mat_b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for group, (start, end) in enumerate(zip(starts, ends, strict=True)):
            out[start:end] = a[start:end] @ b[group]
        return out
    return torch.stack(
        [a[:, start:end] @ b[start:end] for start, end in zip(starts, ends, strict=True)]
    )
