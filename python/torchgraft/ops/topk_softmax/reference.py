"""The routing as transformers' MoE routers compute it, in torch's own ops."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["topk_softmax_reference"]


def topk_softmax_reference(logits: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``(weights, indices)`` of ``logits`` ``(..., experts)``: softmax in float32 (float64 for
    float64 logits), the ``k`` largest probabilities, divided by their sum when ``renormalize``.
    Differentiable with respect to ``logits``.

    The models call ``torch.topk``, whose order among equal probabilities is unspecified; this
    takes them lower expert first (a stable descending sort, NaN first as in ``torch.topk``), as
    the kernel does, so that every device gives one answer."""
    experts = logits.shape[-1] if logits.dim() else 1
    if not 0 <= k <= experts:
        raise RuntimeError("selected index k out of range")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits, dim=-1, dtype=dtype)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, indices = ranked[..., :k], order[..., :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices
