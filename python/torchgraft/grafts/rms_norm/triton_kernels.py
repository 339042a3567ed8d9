"""Triton RMSNorm kernels and their launchers.

The only module of the package that imports triton; everything else imports it lazily.

Forward: one program per tile of ``rows`` rows (one row for wide rows), the row held in
registers, float32 accumulation (float64 for float64 inputs); rows wider than the largest
register block are processed in chunks (a pass for the mean square, a pass for ``y``).

Backward: a persistent grid (a few programs per SM) whose programs stride over row tiles;
each reads ``x`` and ``dy`` once per row, writes ``dx`` and accumulates its share of ``dw`` in
registers, then writes one float32 partial row. A second small kernel sums the partial rows
in a fixed order (deterministic, no atomics) and writes ``dw`` in the weight's dtype.

Loops are ``while`` loops: triton 3.6's interpreter (TRITON_INTERPRET=1, used by the CPU
tests) cannot iterate ``range`` over a run-time int with numpy >= 2.3.
"""
# Triton reads the annotations of kernel parameters (tl.constexpr marks compile-time ones),
# so the other kernel parameters stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "BackwardConfig",
    "ForwardConfig",
    "backward_config",
    "backward_num_programs",
    "forward_config",
    "rms_norm_backward",
    "rms_norm_forward",
]


@triton.jit
def _upcast(v, IS_FP64: tl.constexpr):
    if IS_FP64:
        return v.to(tl.float64)
    else:
        return v.to(tl.float32)


@triton.jit
def _rsqrt(v, IS_FP64: tl.constexpr):
    if IS_FP64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.rsqrt(v)


# Row counts only bound loops and masks: no recompiling for rows == 1 or rows % 16 == 0.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    IS_FP64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    row_start = rows.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_PASS:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        offs = row_start[:, None] + cols[None, :]
        x = _upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), IS_FP64)
        rstd = _rsqrt(tl.sum(x * x, axis=1) / n_cols + eps, IS_FP64)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            w = _upcast(tl.load(w_ptr + cols, mask=col_mask, other=0.0), IS_FP64)
            y = y * w[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([ROWS, BLOCK_N], dtype=tl.float64 if IS_FP64 else tl.float32)
        start = 0
        while start < n_cols:
            c = start + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = _upcast(
                tl.load(x_ptr + row_start[:, None] + c[None, :], mask=mask, other=0.0), IS_FP64
            )
            sum_sq += x * x
            start += BLOCK_N
        rstd = _rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps, IS_FP64)
        start = 0
        while start < n_cols:
            c = start + cols
            col_mask = c < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            offs = row_start[:, None] + c[None, :]
            x = _upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), IS_FP64)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                w = _upcast(tl.load(w_ptr + c, mask=col_mask, other=0.0), IS_FP64)
                y = y * w[None, :]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
            start += BLOCK_N
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _load_tile(
    x_ptr, dy_ptr, rstd_ptr, tile, n_rows, n_cols, tile_rows, cols, col_mask, ROWS: tl.constexpr
):
    """x, dy (as stored) and rstd of one tile of rows; nothing past the last row."""
    rows = tile * ROWS + tile_rows
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    return x, dy, rstd


@triton.jit(do_not_specialize=["n_rows", "num_programs"])
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    n_rows,
    n_cols,
    num_programs,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    IS_FP64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # dx = (g - xhat * mean(g * xhat)) * rstd with xhat = x * rstd, g = dy * w;
    # dw = sum over rows of dy * xhat, this program's rows into its partial row.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    tile_rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    part_row = dw_part_ptr + pid.to(tl.int64) * n_cols
    if SINGLE_PASS:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = _upcast(tl.load(w_ptr + cols, mask=col_mask, other=0.0), IS_FP64)
        dw_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float64 if IS_FP64 else tl.float32)
        tile = pid
        x_in, dy_in, rstd_in = _load_tile(
            x_ptr, dy_ptr, rstd_ptr, tile, n_rows, n_cols, tile_rows, cols, col_mask, ROWS
        )
        while tile < n_tiles:
            if PREFETCH:
                # Issue the next tile's loads before computing this one: more bytes in flight.
                x_next, dy_next, rstd_next = _load_tile(
                    x_ptr,
                    dy_ptr,
                    rstd_ptr,
                    tile + num_programs,
                    n_rows,
                    n_cols,
                    tile_rows,
                    cols,
                    col_mask,
                    ROWS,
                )
            rows = tile * ROWS + tile_rows
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
            x = _upcast(x_in, IS_FP64)
            dy = _upcast(dy_in, IS_FP64)
            rstd = _upcast(rstd_in, IS_FP64)
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            if COMPUTE_DX:
                mean_gx = tl.sum(g * xhat, axis=1) / n_cols
                dx = (g - xhat * mean_gx[:, None]) * rstd[:, None]
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * xhat
            tile += num_programs
            if PREFETCH:
                x_in = x_next
                dy_in = dy_next
                rstd_in = rstd_next
            else:
                x_in, dy_in, rstd_in = _load_tile(
                    x_ptr, dy_ptr, rstd_ptr, tile, n_rows, n_cols, tile_rows, cols, col_mask, ROWS
                )
        if COMPUTE_DW:
            tl.store(part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # Rows too wide for registers: a first pass over the row's chunks for mean(g * xhat),
        # a second (re-reading the row, mostly from L2) for dx and this program's partial dw,
        # which lives in its partial row (zeroed by the launcher) instead of registers.
        tile = pid
        while tile < n_tiles:
            rows = tile * ROWS + tile_rows
            row_mask = rows < n_rows
            row_start = rows.to(tl.int64) * n_cols
            rstd = _upcast(tl.load(rstd_ptr + rows, mask=row_mask, other=0.0), IS_FP64)
            if COMPUTE_DX:
                dot = tl.zeros([ROWS, BLOCK_N], dtype=tl.float64 if IS_FP64 else tl.float32)
                start = 0
                while start < n_cols:
                    c = start + cols
                    col_mask = c < n_cols
                    mask = row_mask[:, None] & col_mask[None, :]
                    offs = row_start[:, None] + c[None, :]
                    x = _upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), IS_FP64)
                    g = _upcast(tl.load(dy_ptr + offs, mask=mask, other=0.0), IS_FP64)
                    if HAS_WEIGHT:
                        w = _upcast(tl.load(w_ptr + c, mask=col_mask, other=0.0), IS_FP64)
                        g = g * w[None, :]
                    dot += g * x
                    start += BLOCK_N
                mean_gx = tl.sum(dot, axis=1) * rstd / n_cols
            start = 0
            while start < n_cols:
                c = start + cols
                col_mask = c < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                offs = row_start[:, None] + c[None, :]
                x = _upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), IS_FP64)
                dy = _upcast(tl.load(dy_ptr + offs, mask=mask, other=0.0), IS_FP64)
                xhat = x * rstd[:, None]
                if COMPUTE_DX:
                    if HAS_WEIGHT:
                        w = _upcast(tl.load(w_ptr + c, mask=col_mask, other=0.0), IS_FP64)
                        g = dy * w[None, :]
                    else:
                        g = dy
                    dx = (g - xhat * mean_gx[:, None]) * rstd[:, None]
                    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    part = tl.load(part_row + c, mask=col_mask, other=0.0)
                    tl.store(part_row + c, part + tl.sum(dy * xhat, axis=0), mask=col_mask)
                start += BLOCK_N
            # The next tile reads back the partial row that other threads of this program
            # just stored: make those stores visible first.
            tl.debug_barrier()
            tile += num_programs


@triton.jit(do_not_specialize=["n_parts"])
def _dw_reduce_kernel(
    part_ptr,
    dw_ptr,
    n_parts,
    n_cols,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Sums the partial rows in a fixed order, so dw is bit-for-bit reproducible.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=part_ptr.dtype.element_ty)
    start = 0
    while start < n_parts:
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        offs = parts.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc += tl.load(part_ptr + offs, mask=mask, other=0.0)
        start += BLOCK_P
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Launch shape of the forward kernel.

    Attributes:
        block_n: columns a program holds at once (a power of two).
        rows: rows per program (a power of two).
        num_warps: warps per program.
        single_pass: the whole row fits in ``block_n``; otherwise it is read in chunks.
    """

    block_n: int
    rows: int
    num_warps: int
    single_pass: bool


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Launch shape of the backward kernel.

    Attributes:
        block_n: columns a program holds at once (a power of two).
        rows: rows per tile (a power of two).
        num_warps: warps per program.
        single_pass: the whole row fits in ``block_n``; otherwise it is read in chunks.
        programs_per_sm: persistent programs per multiprocessor.
        prefetch: (single pass) load the next tile before computing the current one.
    """

    block_n: int
    rows: int
    num_warps: int
    single_pass: bool
    programs_per_sm: int
    prefetch: bool = False


# Widest row (in elements) a program keeps in registers; wider rows loop over chunks of
# _CHUNK elements. The backward holds x, dy, w and the dw accumulator per element, the
# forward only x.
_FWD_MAX_BLOCK = 16384
_BWD_MAX_BLOCK = 8192
_CHUNK = 4096
# Elements per program tile for narrow rows (several rows per program).
_TILE = 2048


def _warps_for(tile_elems: int) -> int:
    # About 16 elements per thread: 16-byte loads for 16-bit types, a few in flight.
    return max(1, min(16, tile_elems // 512))


@functools.lru_cache(maxsize=256)
def forward_config(n_cols: int, dtype: torch.dtype) -> ForwardConfig:
    """The forward's launch shape for rows of ``n_cols`` elements of ``dtype``."""
    max_block = _FWD_MAX_BLOCK // 2 if dtype == torch.float64 else _FWD_MAX_BLOCK
    block_n = max(16, triton.next_power_of_2(n_cols))
    if block_n > max_block:
        return ForwardConfig(_CHUNK, 1, _warps_for(_CHUNK), False)
    rows = max(1, _TILE // block_n)
    return ForwardConfig(block_n, rows, _warps_for(block_n * rows), True)


@functools.lru_cache(maxsize=256)
def backward_config(n_cols: int, dtype: torch.dtype) -> BackwardConfig:
    """The backward's launch shape for rows of ``n_cols`` elements of ``dtype``."""
    max_block = _BWD_MAX_BLOCK // 2 if dtype == torch.float64 else _BWD_MAX_BLOCK
    block_n = max(16, triton.next_power_of_2(n_cols))
    if block_n > max_block:
        return BackwardConfig(_CHUNK, 1, _warps_for(_CHUNK), False, 2)
    rows = max(1, _TILE // block_n)
    warps = _warps_for(block_n * rows)
    return BackwardConfig(block_n, rows, warps, True, 4 if warps <= 4 else 2, prefetch=True)


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # CPU tensors only run under TRITON_INTERPRET=1: a small "grid" so that the
    # persistent loop takes several trips in the tests.
    return 2


def backward_num_programs(n_rows: int, config: BackwardConfig, device: torch.device) -> int:
    """Persistent grid size: ``programs_per_sm`` per multiprocessor, at most one per tile."""
    n_tiles = triton.cdiv(n_rows, config.rows)
    return max(1, min(n_tiles, config.programs_per_sm * _multiprocessors(device)))


def _on_device(x: Tensor) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current device; kernels called from Python (a graft's impl, a
    # custom op) get no device guard from the dispatcher.
    if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


Wrap = Callable[[Any], Any]


def _launchable(kernel: Any, wrap: Wrap | None) -> Any:
    return kernel if wrap is None else wrap(kernel)


def rms_norm_forward(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    y: Tensor,
    rstd: Tensor,
    config: ForwardConfig | None = None,
    wrap: Wrap | None = None,
) -> None:
    """Runs the forward kernel: writes ``y`` and ``rstd``.

    Args:
        x: ``(rows, n)`` contiguous input (float32, float16, bfloat16 or float64).
        weight: ``(n,)`` contiguous, ``x``'s dtype, or ``None``.
        eps: added to the mean square.
        y: ``(rows, n)`` contiguous output, ``x``'s dtype.
        rstd: ``(rows,)`` contiguous output, float32 (float64 for float64 ``x``).
        config: launch shape; :func:`forward_config` when ``None``.
        wrap: applied to each kernel before launching (``torch.library.wrap_triton`` inside a
            ``triton_op``); ``None`` launches them as they are.
    """
    n_rows, n_cols = x.shape
    cfg = config or forward_config(n_cols, x.dtype)
    grid = (triton.cdiv(n_rows, cfg.rows),)
    with _on_device(x):
        _launchable(_rms_norm_fwd_kernel, wrap)[grid](
            x,
            weight if weight is not None else x,
            y,
            rstd,
            n_rows,
            n_cols,
            eps,
            HAS_WEIGHT=weight is not None,
            IS_FP64=x.dtype == torch.float64,
            BLOCK_N=cfg.block_n,
            ROWS=cfg.rows,
            SINGLE_PASS=cfg.single_pass,
            num_warps=cfg.num_warps,
        )


def rms_norm_backward(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    dx: Tensor | None,
    dw: Tensor | None,
    config: BackwardConfig | None = None,
    num_programs: int | None = None,
    partials: Tensor | None = None,
    wrap: Wrap | None = None,
) -> None:
    """Runs the backward kernels: writes ``dx`` and ``dw`` where given.

    Args:
        dy: ``(rows, n)`` contiguous gradient of ``y``, ``x``'s dtype.
        x: ``(rows, n)`` contiguous forward input.
        rstd: ``(rows,)`` contiguous, from the forward.
        weight: ``(n,)`` contiguous or ``None``.
        dx: ``(rows, n)`` contiguous output or ``None`` to skip it.
        dw: ``(n,)`` contiguous output in the weight's dtype, or ``None`` to skip it; needs
            ``weight``.
        config: launch shape; :func:`backward_config` when ``None``.
        num_programs: persistent grid size; :func:`backward_num_programs` when ``None``.
        partials: scratch for the per-program dw rows, ``(num_programs, n)`` contiguous in the
            accumulation dtype; allocated when ``None``.
        wrap: as in :func:`rms_norm_forward`.
    """
    if dw is not None and weight is None:
        raise ValueError("dw needs a weight")
    if dx is None and dw is None:
        return
    n_rows, n_cols = x.shape
    cfg = config or backward_config(n_cols, x.dtype)
    programs = num_programs or backward_num_programs(n_rows, cfg, x.device)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if dw is not None:
        if partials is None:
            # The chunked kernel adds into its partial row, the single-pass one overwrites it.
            alloc = torch.empty if cfg.single_pass else torch.zeros
            partials = alloc((programs, n_cols), dtype=acc_dtype, device=x.device)
        elif not cfg.single_pass:
            partials.zero_()
    with _on_device(x):
        _launchable(_rms_norm_bwd_kernel, wrap)[(programs,)](
            dy,
            x,
            weight if weight is not None else x,
            rstd,
            dx if dx is not None else x,
            partials if partials is not None else rstd,
            n_rows,
            n_cols,
            programs,
            HAS_WEIGHT=weight is not None,
            COMPUTE_DX=dx is not None,
            COMPUTE_DW=dw is not None,
            IS_FP64=x.dtype == torch.float64,
            BLOCK_N=cfg.block_n,
            ROWS=cfg.rows,
            SINGLE_PASS=cfg.single_pass,
            PREFETCH=cfg.prefetch,
            num_warps=cfg.num_warps,
        )
        if dw is not None:
            block_cols = 64
            _launchable(_dw_reduce_kernel, wrap)[(triton.cdiv(n_cols, block_cols),)](
                partials,
                dw,
                programs,
                n_cols,
                BLOCK_P=32,
                BLOCK_N=block_cols,
                num_warps=4,
            )
