"""Scaled dot-product attention in plain PyTorch: the reference FA4 is tested against.

Computes in float64 by default, on the inputs' device, with SDPA's conventions: inputs
``(batch, heads, seq, head_dim)``, key/value heads shared by groups of query heads (GQA), the
causal mask aligned top-left, ``scale`` None meaning ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["attention_reference"]


def attention_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """``(output, logsumexp)``: ``softmax(q k^T * scale) v`` and the natural-log log-sum-exp of
    each row of scaled scores, ``(batch, heads, seq_q)``, both in ``compute_dtype``.

    Differentiable: gradients through it are the reference gradients.
    """
    q, k, v = (t.to(compute_dtype) for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    if group != 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        seq_q, seq_k = scores.shape[-2:]
        keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v), lse
