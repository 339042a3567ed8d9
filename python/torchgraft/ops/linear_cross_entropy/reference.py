"""The meaning of torchgraft's fused linear cross-entropy, in plain PyTorch (float64)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from torchgraft.ops.cross_entropy.reference import cross_entropy_eager, cross_entropy_reference

__all__ = ["linear_cross_entropy_eager", "linear_cross_entropy_reference"]


def linear_cross_entropy_eager(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` as models write it, with the
    ``(..., V)`` logits flattened to rows."""
    return cross_entropy_eager(F.linear(hidden, weight, bias), target, ignore_index, reduction)


def linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` with full float64 logits."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    return cross_entropy_reference(logits, target, ignore_index, reduction)
