"""Where the Triton RMSNorm beats aten's CUDA kernel: the size gate the conds apply.

Each table lists ``(max_hidden, min_rows)`` pairs in increasing ``max_hidden``: a call whose
hidden size (the product of ``normalized_shape``) is at most ``max_hidden`` takes the Triton
route when it has at least ``min_rows`` rows (never when ``min_rows`` is ``None``), the first
matching pair deciding. Hidden sizes under ``MIN_HIDDEN`` or over the last ``max_hidden`` stay
on aten, and so do rows that do not start 16-byte aligned (not measured).

Measured on an H100 (torch 2.11, triton 3.6) by ``bench/rms_norm_sweep.py``: the Triton
route counts as winning where it beat aten both in GPU time (do_bench) and in back-to-back
host-timed calls. The sweep's table is bench/results/rms_norm_sweep.md.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_HIDDEN", "wins_backward", "wins_forward"]

MIN_HIDDEN = 1024

# Tables per dtype group: 16-bit types, and float32.
Table = tuple[tuple[int, int | None], ...]
FORWARD_MIN_ROWS: dict[str, Table] = {
    "16bit": (
        (1024, None),
        (2048, 32768),
        (3072, 16384),
        (4096, 16384),
        (5120, 16384),
        (8192, 4096),
        (12288, 4096),
        (16384, 16384),
    ),
    "float32": (
        (1024, 32768),
        (2048, 16384),
        (3072, 4096),
        (4096, 4096),
        (5120, 4096),
        (8192, 4096),
        (12288, 4096),
        (16384, 1024),
    ),
}
BACKWARD_MIN_ROWS: dict[str, Table] = {
    "16bit": (
        (1024, 32768),
        (2048, 16384),
        (3072, 32768),
        (4096, 16384),
        (5120, 16384),
        (8192, 16384),
        (12288, 16384),
        (16384, 16384),
    ),
    "float32": (
        (1024, 16384),
        (2048, 4096),
        (3072, 4096),
        (4096, 4096),
        (5120, 4096),
        (8192, 4096),
        (12288, 4096),
        (16384, 4096),
    ),
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
