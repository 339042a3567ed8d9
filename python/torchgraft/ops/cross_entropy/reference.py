"""The meaning of torchgraft's cross-entropy, in plain PyTorch (float64)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["cross_entropy_reference"]


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
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.double().reshape(-1, vocab),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
