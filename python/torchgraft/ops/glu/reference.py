"""The meaning of SwiGLU and GeGLU, in plain PyTorch (float64 when the inputs are)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["geglu_reference", "swiglu_reference"]


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` computed in float64, returned in float64."""
    return F.silu(gate.double()) * up.double()


def geglu_reference(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate, approximate) * up`` computed in float64, returned in float64."""
    return F.gelu(gate.double(), approximate=approximate) * up.double()
