"""The meaning of torchgraft's cross-entropy, in plain PyTorch (float64)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["cross_entropy_eager", "cross_entropy_reference", "rows_of"]


def rows_of(x: Tensor) -> Tensor:
    """``(..., V)`` as ``(N, V)`` rows: the leading dimensions flattened (one row for a 1-D
    ``x``), also with ``V = 0``, where ``reshape(-1, V)`` cannot tell ``N``."""
    return x.flatten(0, -2) if x.dim() > 1 else x.unsqueeze(0)


def cross_entropy_eager(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` of ``(..., V)`` logits flattened to rows, in the logits' dtype.

    The loss has the target's shape for ``reduction="none"``, else it is a scalar.
    """
    loss = F.cross_entropy(
        rows_of(logits),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def cross_entropy_reference(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` of ``(..., V)`` logits flattened to rows, computed in float64.

    The loss has the target's shape for ``reduction="none"``, else it is a scalar.
    """
    loss = F.cross_entropy(
        rows_of(logits.double()),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
