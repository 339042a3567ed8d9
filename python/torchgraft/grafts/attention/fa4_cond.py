"""Which SDPA calls the FA4 impls take: what FA4 can compute, where it is measured faster.

Each cond runs on every call and reads metadata only. It declines, so ATen runs the call:

* what FA4 cannot compute (:mod:`.support`: device and arch, dtype, head dims, layouts,
  causal with unequal lengths) and what these impls do not implement (dropout, an attention
  bias, ``return_debug_mask``, nested/varlen inputs);
* problems where the measured crossover (:mod:`.crossover`) says the kernel it would replace
  is as fast or faster (each pass decided on its own);
* everything, once importing FA4 has failed.

:func:`why_not` gives the reason in words (for tests and diagnostics).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import crossover
from .fa4_impl import FA4
from .support import Problem, decline_reason, device_capability

__all__ = [
    "cudnn_attention_backward_cond",
    "cudnn_attention_cond",
    "flash_attention_backward_cond",
    "flash_attention_cond",
    "why_not",
]


def why_not(
    baseline: crossover.Baseline,
    which: crossover.Pass,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    dropout_p: float,
    *extra: Tensor | None,
) -> str | None:
    """Why FA4 should not run this pass of this call, or None when it should."""
    if FA4.failed:
        return f"FA4 could not be imported ({FA4.error})"
    if dropout_p != 0.0:
        return "dropout"
    reason = decline_reason(query, key, value, is_causal, *extra)
    if reason is not None:
        return reason
    problem = Problem.of(query, key, value, is_causal, device_capability(query.device.index))
    if problem is None or not crossover.wins(baseline, which, problem):
        return f"the {baseline} {which} is as fast or faster here (crossover table)"
    return None


def _lse_fits(lse: Tensor, query: Tensor, trailing: tuple[int, ...]) -> bool:
    expected = (query.shape[0], query.shape[1], query.shape[2], *trailing)
    return lse.dtype == torch.float32 and tuple(lse.shape) == expected


def flash_attention_cond(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> bool:
    """True when FA4 should compute this ``aten::_scaled_dot_product_flash_attention``."""
    if return_debug_mask:
        return False
    return why_not("flash", "forward", query, key, value, is_causal, dropout_p) is None


def flash_attention_backward_cond(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    cum_seq_q: Tensor | None,
    cum_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Tensor,
    philox_offset: Tensor,
    *,
    scale: float | None = None,
) -> bool:
    """True when FA4 should compute this ``..._flash_attention_backward``."""
    if cum_seq_q is not None or cum_seq_k is not None:
        return False
    if grad_out.shape != out.shape or out.shape != query.shape[:3] + value.shape[3:]:
        return False
    if not _lse_fits(logsumexp, query, ()):
        return False
    return (
        why_not(
            "flash", "backward", query, key, value, is_causal, dropout_p, grad_out, out, logsumexp
        )
        is None
    )


def cudnn_attention_cond(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> bool:
    """True when FA4 should compute this ``aten::_scaled_dot_product_cudnn_attention``."""
    if attn_bias is not None or return_debug_mask:
        return False
    return why_not("cudnn", "forward", query, key, value, is_causal, dropout_p) is None


def cudnn_attention_backward_cond(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    philox_seed: Tensor,
    philox_offset: Tensor,
    attn_bias: Tensor | None,
    cum_seq_q: Tensor | None,
    cum_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    *,
    scale: float | None = None,
) -> bool:
    """True when FA4 should compute this ``..._cudnn_attention_backward``."""
    if attn_bias is not None or cum_seq_q is not None or cum_seq_k is not None:
        return False
    if grad_out.shape != out.shape or out.shape != query.shape[:3] + value.shape[3:]:
        return False
    if not _lse_fits(logsumexp, query, (1,)):
        return False
    return (
        why_not(
            "cudnn", "backward", query, key, value, is_causal, dropout_p, grad_out, out, logsumexp
        )
        is None
    )
