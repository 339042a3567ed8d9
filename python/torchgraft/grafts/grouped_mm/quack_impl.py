"""quack's grouped GEMM as the implementation of ``aten::_grouped_mm``.

It returns what ATen returns: the result in bfloat16, contiguous (the cond takes only N a
multiple of 8, where ATen's layout is contiguous too), so ATen's derivative formula, torch.compile
(which plans with the op's meta function) and a backward run by another kernel keep working.

quack is imported on the first call. If that import fails, the impl calls the op again, which
reaches the kernel below (ATen's), and the cond declines from then on. If quack refuses a call
the cond let through (its checks raise AssertionError, ValueError or NotImplementedError), that
call goes to ATen too, with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from torchgraft.common.device import on_device_of
from torchgraft.dsl.lazy import LazyKernels

__all__ = ["QUACK", "grouped_mm_impl"]

#: The quack kernel module, imported on first use.
QUACK = LazyKernels("torchgraft.grafts.grouped_mm.quack_kernels")

log = logging.getLogger("torchgraft.grafts.grouped_mm")

#: What quack's interface raises for a problem it does not take (its argument checks).
_REFUSALS = (AssertionError, ValueError, NotImplementedError)


def grouped_mm_impl(
    mat_a: Tensor,
    mat_b: Tensor,
    offs: Tensor | None = None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``aten::_grouped_mm`` through quack (the calls :mod:`.quack_cond` takes)."""
    kernels = QUACK.get()
    if kernels is not None and offs is not None:
        try:
            with on_device_of(mat_a):
                return kernels.grouped_mm(mat_a, mat_b, offs)
        except _REFUSALS as error:
            log.warning(
                "quack refused a grouped GEMM its cond accepted (%s x %s, strides %s x %s): %s; "
                "ATen runs it",
                tuple(mat_a.shape),
                tuple(mat_b.shape),
                mat_a.stride(),
                mat_b.stride(),
                error,
            )
    return torch.ops.aten._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
