"""RMSNorm forward and backward written in cuTile (the cuda-tile package, ``cuda.tile``).

Importing this module imports cuda.tile; the impls in :mod:`.dsl_impl` import it on their first
call, never at registration. cuTile compiles a kernel per set of constants (tile shapes, the
row length) and array dtypes on its first launch, through NVIDIA's ``tileiras`` (which needs the
matching ``nvidia-cuda-nvcc`` and ``nvidia-nvvm``: ptxas and libNVVM).

Rows are ``(rows, hidden)`` contiguous tensors; math in float32, like ATen's CUDA kernel. cuTile
tiles have power-of-two shapes: a row is loaded as one tile of ``next_pow2(hidden)`` elements,
zero-padded past its end (zeros add nothing to the sums; the sums divide by ``hidden``), and
stores past the end are dropped. The conds bound the row length
(:data:`.dsl_cond.CUTILE_MAX_HIDDEN`).
"""

from __future__ import annotations

import functools
import io
from typing import Any

import cuda.tile as ct
import torch
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    KernelSignature,
    ScalarConstraint,
    export_kernel,
)
from torch import Tensor

__all__ = ["backward", "compile_ahead", "forward", "tile_shape"]

#: Elements a program aims to hold per tile: narrow rows are grouped into blocks of rows.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_ROWS = 64
#: Backward programs per SM (each loops over its share of row blocks and writes one partial dw).
_PROGRAMS_PER_SM = 2

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def _forward_kernel(
    x: ct.Array,
    weight: ct.Array,
    y: ct.Array,
    rstd: ct.Array,
    eps: float,
    hidden: ct.Constant[int],
    block_rows: ct.Constant[int],
    tile_n: ct.Constant[int],
) -> None:
    block = ct.bid(0)
    xf = ct.astype(ct.load(x, (block, 0), (block_rows, tile_n), padding_mode=_ZERO), ct.float32)
    wf = ct.astype(ct.load(weight, (0,), (tile_n,), padding_mode=_ZERO), ct.float32)
    wf = ct.reshape(wf, (1, tile_n))
    mean_square = ct.sum(xf * xf, axis=1, keepdims=True) / hidden
    inv = ct.rsqrt(mean_square + eps)
    ct.store(y, (block, 0), ct.astype(xf * inv * wf, y.dtype))
    ct.store(rstd, (block,), ct.reshape(inv, (block_rows,)))


@ct.kernel
def _backward_kernel(
    grad_out: ct.Array,
    x: ct.Array,
    rstd: ct.Array,
    weight: ct.Array,
    dx: ct.Array,
    dw_parts: ct.Array,
    blocks_per_program: int,
    n_blocks: int,
    hidden: ct.Constant[int],
    block_rows: ct.Constant[int],
    tile_n: ct.Constant[int],
) -> None:
    # dx = rstd * (w*g - xhat * mean(xhat * w*g)); dw = sum over rows of g * xhat, summed per
    # program into its own row of dw_parts, which the caller reduces: no atomics, so the
    # result does not depend on scheduling.
    program = ct.bid(0)
    wf = ct.reshape(
        ct.astype(ct.load(weight, (0,), (tile_n,), padding_mode=_ZERO), ct.float32), (1, tile_n)
    )
    dw_acc = ct.zeros((1, tile_n), dtype=ct.float32)
    first = program * blocks_per_program
    last = ct.minimum(first + blocks_per_program, n_blocks)
    for block in range(first, last):
        inv = ct.load(rstd, (block,), (block_rows,), padding_mode=_ZERO)
        inv = ct.reshape(inv, (block_rows, 1))
        xhat = ct.astype(
            ct.load(x, (block, 0), (block_rows, tile_n), padding_mode=_ZERO), ct.float32
        )
        xhat = xhat * inv
        g = ct.astype(
            ct.load(grad_out, (block, 0), (block_rows, tile_n), padding_mode=_ZERO), ct.float32
        )
        wg = g * wf
        proj = ct.sum(xhat * wg, axis=1, keepdims=True) / hidden
        ct.store(dx, (block, 0), ct.astype((wg - xhat * proj) * inv, dx.dtype))
        dw_acc = dw_acc + ct.sum(g * xhat, axis=0, keepdims=True)
    ct.store(dw_parts, (program, 0), dw_acc)


def tile_shape(hidden: int) -> tuple[int, int]:
    """``(block_rows, tile_n)``: rows per tile and the padded (power-of-two) row length."""
    tile_n = 1 << max(hidden - 1, 0).bit_length()
    block_rows = max(1, min(_MAX_BLOCK_ROWS, _TILE_ELEMENTS // tile_n))
    return block_rows, tile_n


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of the rows of ``x``."""
    rows, hidden = x.shape
    block_rows, tile_n = tile_shape(hidden)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        ct.launch(
            torch.cuda.current_stream(),
            (-(-rows // block_rows),),
            _forward_kernel,
            (x, weight, y, rstd, float(eps), hidden, block_rows, tile_n),
        )
    return y, rstd


def backward(grad_out: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dw)``; ``dw`` summed in float32 and cast to the weight's dtype."""
    rows, hidden = x.shape
    block_rows, tile_n = tile_shape(hidden)
    n_blocks = -(-rows // block_rows)
    programs = max(1, min(n_blocks, _PROGRAMS_PER_SM * _sm_count(x.device.index or 0)))
    blocks_per_program = -(-n_blocks // programs)
    programs = -(-n_blocks // blocks_per_program) if n_blocks else 1
    dx = torch.empty_like(x)
    dw_parts = torch.zeros(programs, hidden, dtype=torch.float32, device=x.device)
    if rows:
        ct.launch(
            torch.cuda.current_stream(),
            (programs,),
            _backward_kernel,
            (
                grad_out,
                x,
                rstd,
                weight,
                dx,
                dw_parts,
                blocks_per_program,
                n_blocks,
                hidden,
                block_rows,
                tile_n,
            ),
        )
    return dx, dw_parts.sum(0).to(weight.dtype)


# ---- ahead of time (no GPU): what the first launch would compile ------------------------------

_CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32}


def _array(dtype: Any, ndim: int) -> ArrayConstraint:
    # What torch's contiguous tensors satisfy: non-negative strides, no aliasing.
    return ArrayConstraint(
        dtype,
        ndim,
        index_dtype=ct.int32,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
    )


def _signatures(hidden: int, dtype: torch.dtype) -> dict[str, tuple[Any, KernelSignature]]:
    block_rows, tile_n = tile_shape(hidden)
    x, f32 = _CT_DTYPES[dtype], ct.float32
    constants = [hidden, block_rows, tile_n]
    cc = CallingConvention.cutile_python_v1()
    forward_args = [_array(x, 2), _array(x, 1), _array(x, 2), _array(f32, 1)]
    backward_args = [_array(x, 2), _array(x, 2), _array(f32, 1), _array(x, 1), _array(x, 2)]
    return {
        "forward": (
            _forward_kernel,
            KernelSignature([*forward_args, ScalarConstraint(f32), *constants], cc),
        ),
        "backward": (
            _backward_kernel,
            KernelSignature(
                [
                    *backward_args,
                    _array(f32, 2),
                    ScalarConstraint(ct.int32),
                    ScalarConstraint(ct.int32),
                    *constants,
                ],
                cc,
            ),
        ),
    }


def compile_ahead(
    arch: str, hidden: int, dtype: torch.dtype, output_format: str = "cubin"
) -> dict[str, bytes]:
    """``{"forward": ..., "backward": ...}``: both kernels compiled for ``arch`` (``"sm_90"``)
    at one row length and dtype, as cubins (or ``"tileir_bytecode"``), with no GPU.

    cuTile's ``export_kernel`` runs the whole toolchain (Tile IR bytecode, tileiras, libNVVM,
    ptxas), so this shows whether the installed toolchain compiles the kernels for a GPU
    generation, apart from launching them.
    """
    result = {}
    for name, (kernel, signature) in _signatures(hidden, dtype).items():
        out = io.BytesIO()
        export_kernel(kernel, [signature], out, gpu_code=arch, output_format=output_format)
        result[name] = out.getvalue()
    return result
