"""Where the Triton RMSNorm beats aten's CUDA kernel: the size gate the conds apply.

Each table lists ``(max_hidden, min_rows)`` pairs in increasing ``max_hidden``: a call whose
hidden size (the product of ``normalized_shape``) is at most ``max_hidden`` takes the Triton
route when it has at least ``min_rows`` rows (never when ``min_rows`` is ``None``), the first
matching pair deciding. Hidden sizes under ``MIN_HIDDEN`` or over the last ``max_hidden`` stay
on aten, and so do rows that do not start 16-byte aligned (not measured).

PLACEHOLDER: these values are the seeds' conservative guess (hidden 1024..16384, 4096 rows
and up), not a measurement. ``bench/rms_norm_sweep.py`` measures the crossover on a GPU and
prints tables in this format to replace them.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_HIDDEN", "wins_backward", "wins_forward"]

MIN_HIDDEN = 1024

# Tables per dtype group: 16-bit types, and float32.
Table = tuple[tuple[int, int | None], ...]
FORWARD_MIN_ROWS: dict[str, Table] = {
    "16bit": ((16384, 4096),),
    "float32": ((16384, 4096),),
}
BACKWARD_MIN_ROWS: dict[str, Table] = {
    "16bit": ((16384, 4096),),
    "float32": ((16384, 4096),),
}


def _wins(tables: dict[str, Table], dtype: torch.dtype, n_cols: int, n_rows: int) -> bool:
    itemsize = 4 if dtype == torch.float32 else 2
    if n_cols < MIN_HIDDEN or (n_cols * itemsize) % 16:
        return False
    for max_hidden, min_rows in tables["float32" if dtype == torch.float32 else "16bit"]:
        if n_cols <= max_hidden:
            return min_rows is not None and n_rows >= min_rows
    return False


def wins_forward(dtype: torch.dtype, n_cols: int, n_rows: int) -> bool:
    """Whether the Triton forward is expected to beat aten's for this problem."""
    return _wins(FORWARD_MIN_ROWS, dtype, n_cols, n_rows)


def wins_backward(dtype: torch.dtype, n_cols: int, n_rows: int) -> bool:
    """Whether the Triton backward is expected to beat aten's for this problem."""
    return _wins(BACKWARD_MIN_ROWS, dtype, n_cols, n_rows)
