"""The meaning of SwiGLU and GeGLU, in plain PyTorch (float64 when the inputs are)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "check_halving",
    "geglu_eager",
    "geglu_reference",
    "swiglu_eager",
    "swiglu_packed_eager",
    "swiglu_packed_reference",
    "swiglu_reference",
]


def swiglu_eager(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` as models write it, in the inputs' dtypes."""
    return F.silu(gate) * up


def geglu_eager(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` as models write it."""
    return F.gelu(gate, approximate=approximate) * up


def check_halving(op: str, gate_up: Tensor) -> None:
    """A packed ``gate_up`` needs a last dimension of even size: ``RuntimeError`` with ATen's
    ``glu`` messages otherwise (``chunk(2)`` alone would split an odd size unevenly)."""
    if gate_up.dim() == 0:
        raise RuntimeError(f"{op} does not support scalars because halving size must be even")
    last = gate_up.shape[-1]
    if last % 2 != 0:
        raise RuntimeError(
            f"{op}: Halving dimension must be even, but dimension {gate_up.dim() - 1} "
            f"is size {last}"
        )


def swiglu_packed_eager(gate_up: Tensor) -> Tensor:
    """transformers' MoE ``_apply_gate``: ``gate, up = gate_up.chunk(2, dim=-1)``, then
    ``F.silu(gate) * up``, in the input's dtype."""
    check_halving("swiglu_packed", gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_packed_reference(gate_up: Tensor) -> Tensor:
    """:func:`swiglu_packed_eager` computed in float64, returned in float64."""
    return swiglu_packed_eager(gate_up.double())


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` computed in float64, returned in float64."""
    return F.silu(gate.double()) * up.double()


def geglu_reference(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate, approximate) * up`` computed in float64, returned in float64.

    GELU is written as ``F.gelu`` defines it, but with its CDF factor in a form that does not
    cancel for negative gates: ``0.5 * (1 + erf(x / sqrt(2)))`` as ``0.5 * erfc(-x / sqrt(2))``
    and ``0.5 * (1 + tanh(u))`` as ``sigmoid(2 u)``. ``F.gelu`` in float64 loses 3e-3 of
    relative accuracy at x = -7.7 (1 + erf there is 1e-14), which a single-element comparison
    sees; autograd differentiates these forms without the cancellation too.
    """
    x = gate.double()
    if approximate == "tanh":
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
        cdf = torch.sigmoid(2.0 * u)
    elif approximate == "none":
        cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
    else:
        raise ValueError(f"approximate must be 'none' or 'tanh' (got {approximate!r})")
    return x * cdf * up.double()
