"""The meaning of RoPE, in plain PyTorch: transformers' ``apply_rotary_pos_emb``.

With ``cos.size(-1)`` smaller than the head dimension, the leading ``cos.size(-1)`` elements of
each head are rotated and the rest pass through, as Phi-3 and GPT-NeoX apply it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rope_eager", "rope_reference", "rotate_half"]


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_eager(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """``apply_rotary_pos_emb`` as transformers writes it (partial rotary as Phi-3 does)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary = cos.shape[-1]

    def apply(x: Tensor) -> Tensor:
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


def rope_reference(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """[`rope_eager`][] computed in float64, returned in float64."""
    return rope_eager(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)
