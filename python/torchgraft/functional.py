"""torchgraft's fused operators as functions, differentiable and ``torch.compile``-able.

Each runs one ``torch.ops.torchgraft.*`` custom operator (Rust kernels on CPU, CUDA C++ on CUDA)
in place of a chain of aten ops that the dispatcher cannot fuse. Importing this module defines
those operators (it needs the compiled extension); it imports no DSL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.ops.glu import custom_op as _glu  # noqa: F401  (defines the ops' autograd)

__all__ = ["geglu", "swiglu"]

_GELU_APPROXIMATIONS = ("none", "tanh")


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` in one pass (computed in float32, float64 for float64 inputs).

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
    """
    return torch.ops.torchgraft.swiglu(gate, up)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass.

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as for ``F.gelu``.
    """
    if approximate not in _GELU_APPROXIMATIONS:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return torch.ops.torchgraft.geglu(gate, up, approximate == "tanh")
