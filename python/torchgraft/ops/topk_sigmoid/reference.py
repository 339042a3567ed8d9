"""The sigmoid group-limited routing as transformers' DeepSeek-V3 and GLM-4-MoE routers compute
it, in torch's own ops."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RENORMALIZE_EPSILON", "topk_sigmoid_reference"]

RENORMALIZE_EPSILON = 1e-20
"""What the models add to the sum of the selected scores before dividing by it."""


def _ranked(values: Tensor, count: int) -> Tensor:
    """The indices of the ``count`` largest of ``values`` along the last dimension, largest
    first, the lower index first among equals (a stable descending sort; NaN first)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :count]


def topk_sigmoid_reference(
    logits: Tensor,
    bias: Tensor | None,
    k: int,
    groups: int,
    topk_groups: int,
    renormalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(weights, indices)`` of ``logits`` ``(tokens, experts)``: scores ``sigmoid(logits)`` in
    float32 (float64 for float64 logits); the choice by ``scores + bias``, among the experts of
    the ``topk_groups`` groups (of ``groups`` equal groups of adjacent experts) whose two best
    choice scores sum highest; the ``k`` chosen experts' scores, divided by their sum plus
    1e-20 when ``renormalize``, times ``scale``. Differentiable with respect to ``logits``.

    The models call ``torch.topk(..., sorted=False)``, whose order is unspecified; this ranks
    with a stable descending sort, as the kernels do, so that every device gives one answer."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype).sigmoid()
    choice = scores if bias is None else scores + bias
    if groups > 1:
        experts = choice.shape[-1]
        grouped = choice.unflatten(-1, (groups, experts // groups))
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(-1, _ranked(group_scores, topk_groups), True)
        out = ~kept.unsqueeze(-1).expand_as(grouped).flatten(-2)
        choice = choice.masked_fill(out, float("-inf"))
    indices = _ranked(choice, k)
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPSILON)
    return weights * scale, indices
