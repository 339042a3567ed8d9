"""RMSNorm forward and backward written in Helion.

Importing this module imports helion; the impls in :mod:`.dsl_impl` import it on their first
call, never at registration. Each kernel runs with the config :mod:`.helion_configs` picks for
the problem (tuned data, never an autotune at the first call). Helion compiles a kernel per
hidden size and dtype (the row length is specialized; the row count is not). On CPU tensors
the generated Triton code runs in Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests exercise the shipped configs without a GPU.

Rows are ``(rows, hidden)`` contiguous tensors; math in float32, like ATen's CUDA kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import helion
import helion.language as hl
import torch
from torch import Tensor

from .helion_configs import choose

__all__ = ["backward", "forward"]


def _forward_kernel(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rows, hidden = x.size()
    hidden = hl.specialize(hidden)
    y = torch.empty_like(x)
    rstd = torch.empty([rows], dtype=torch.float32, device=x.device)
    for tile in hl.tile(rows):
        xf = x[tile, :].to(torch.float32)
        # sum / hidden, not mean: Helion 1.5.1 can divide a mean by the padded (power-of-two)
        # row length (seen in the backward below). 1/sqrt, not rsqrt: Helion lowers rsqrt to
        # libdevice, which Triton's interpreter (the CPU tests) lacks.
        inv = 1.0 / torch.sqrt(torch.sum(xf * xf, dim=-1) / hidden + eps)
        y[tile, :] = (xf * inv[:, None] * weight[:].to(torch.float32)).to(y.dtype)
        rstd[tile] = inv
    return y, rstd


def _backward_kernel(
    grad_out: Tensor, x: Tensor, rstd: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor]:
    # dx = rstd * (w*g - xhat * mean(xhat * w*g)); dw = sum over rows of g * xhat, summed per
    # block of rows into dw_parts (one row each), which the caller reduces: no atomics, so
    # the result does not depend on scheduling.
    rows, hidden = x.size()
    hidden = hl.specialize(hidden)
    block_rows = hl.register_block_size(rows)
    dx = torch.empty_like(x)
    dw_parts = torch.empty(
        [helion.cdiv(rows, block_rows), hidden], dtype=torch.float32, device=x.device
    )
    for block in hl.tile(rows, block_size=block_rows):
        dw_sum = hl.zeros([hidden], dtype=torch.float32)
        for tile in hl.tile(block.begin, block.end):
            xhat = x[tile, :].to(torch.float32) * rstd[tile][:, None]
            g = grad_out[tile, :].to(torch.float32)
            wg = g * weight[:].to(torch.float32)
            proj = torch.sum(xhat * wg, dim=-1) / hidden
            dx[tile, :] = ((wg - xhat * proj[:, None]) * rstd[tile][:, None]).to(dx.dtype)
            dw_sum = dw_sum + torch.sum(g * xhat, dim=0)
        dw_parts[block.id, :] = dw_sum
    return dx, dw_parts


_BODIES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "forward": _forward_kernel,
    "backward": _backward_kernel,
}


@functools.cache
def _kernel(name: str, config_json: str | None) -> helion.Kernel:
    config = helion.Config.from_json(config_json) if config_json is not None else None
    # static_shapes=False: one compile serves every row count; autotune_effort="none": with no
    # config, Helion's default config, not an autotune.
    return helion.kernel(_BODIES[name], config=config, static_shapes=False, autotune_effort="none")


def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of the rows of ``x``."""
    kernel = _kernel("forward", choose("forward", x.dtype, x.shape[1]))
    return kernel(x, weight, eps)


def backward(grad_out: Tensor, x: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dw)``; ``dw`` summed in float32 and cast to the weight's dtype."""
    kernel = _kernel("backward", choose("backward", x.dtype, x.shape[1]))
    dx, dw_parts = kernel(grad_out, x, rstd, weight)
    return dx, dw_parts.sum(0).to(weight.dtype)
