"""FA4 as implementations of the SDPA ops, returning exactly what ATen returns.

Four impls: ``aten::_scaled_dot_product_flash_attention`` and its backward, and
``aten::_scaled_dot_product_cudnn_attention`` and its backward (SDPA's choice on Hopper). Each
returns ATen's outputs in ATen's format, so ATen's derivative formulas, torch.compile (which
plans with the ops' meta functions) and a backward run by another kernel all keep working:

* ``output`` like ``torch.empty_like(query)`` (same strides), gradients like their inputs;
* ``logsumexp`` float32 ``(batch, heads, seq_q)`` for flash, ``(batch, heads, seq_q, 1)`` for
  cuDNN, natural log (the backward of either kernel can consume the other's);
* ``cum_seq_q`` / ``cum_seq_k`` undefined, ``max_q`` / ``max_k`` the sequence lengths;
* the dropout RNG state as ATen allocates it when there is no dropout: flash ``rng_state``
  uint64 ``(2,)`` and ``unused`` uint64 ``()``, cuDNN seed and offset int64 ``()`` zeros (the
  meta function's shape);
* flash's ``debug_attn_mask`` an empty tensor, cuDNN's undefined.

FA4 is imported on the first call. If that import fails the impl calls the op again, which
reaches the kernel below (ATen's), and the conds decline from then on. If FA4 refuses a call
the conds let through (its own checks raise AssertionError, ValueError or
NotImplementedError), that call goes to ATen too, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from torchgraft.common.device import on_device_of
from torchgraft.dsl.lazy import LazyKernels

__all__ = [
    "FA4",
    "cudnn_attention_backward_impl",
    "cudnn_attention_impl",
    "flash_attention_backward_impl",
    "flash_attention_impl",
]

#: The FA4 kernel module, imported on first use.
FA4 = LazyKernels("torchgraft.grafts.attention.fa4_kernels")

_aten = torch.ops.aten
log = logging.getLogger("torchgraft.grafts.attention")

#: What FA4's interface raises for a problem it does not take (its argument checks).
_REFUSALS = (AssertionError, ValueError, NotImplementedError)


def _bshd(t: Tensor) -> Tensor:
    """``(batch, heads, seq, dim)`` -> FA4's ``(batch, seq, heads, dim)``, a view."""
    return t.transpose(1, 2)


def _laid_out_like(result: Tensor, like: Tensor) -> Tensor:
    """``result`` with the strides ``torch.empty_like(like)`` has (what ATen's meta function
    promises torch.compile), copied only when they differ."""
    strides = torch.empty_like(like, device="meta").stride()
    if result.stride() == strides:
        return result
    return torch.empty_like(like).copy_(result)


def _refused(which: str, query: Tensor, key: Tensor, error: Exception) -> None:
    log.warning(
        "FA4 refused a %s its cond accepted (query %s, key %s, %s): %s; ATen runs it",
        which,
        tuple(query.shape),
        tuple(key.shape),
        query.dtype,
        error,
    )


def _forward(
    query: Tensor, key: Tensor, value: Tensor, scale: float | None, is_causal: bool
) -> tuple[Tensor, Tensor] | None:
    """``(output, lse)`` from FA4, or None when FA4 cannot be imported."""
    kernels = FA4.get()
    if kernels is None:
        return None
    out = torch.empty_like(query)
    try:
        with on_device_of(query):
            lse = kernels.forward(
                _bshd(query), _bshd(key), _bshd(value), _bshd(out), scale, is_causal
            )
    except _REFUSALS as error:
        _refused("forward", query, key, error)
        return None
    return out, lse


def _backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
    is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(grad_query, grad_key, grad_value)`` from FA4, or None when FA4 cannot be imported."""
    kernels = FA4.get()
    if kernels is None:
        return None
    try:
        with on_device_of(query):
            dq, dk, dv = kernels.backward(
                _bshd(grad_out),
                _bshd(query),
                _bshd(key),
                _bshd(value),
                _bshd(out),
                lse,
                scale,
                is_causal,
            )
    except _REFUSALS as error:
        _refused("backward", query, key, error)
        return None
    return (
        _laid_out_like(_bshd(dq), query),
        _laid_out_like(_bshd(dk), key),
        _laid_out_like(_bshd(dv), value),
    )


def flash_attention_impl(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """``aten::_scaled_dot_product_flash_attention`` through FA4 (dropout 0, no debug mask)."""
    result = _forward(query, key, value, scale, is_causal)
    if result is None:
        return _aten._scaled_dot_product_flash_attention.default(
            query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale
        )
    out, lse = result
    rng_state = torch.empty(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    debug_attn_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return (
        out,
        lse,
        None,
        None,
        query.shape[2],
        key.shape[2],
        rng_state,
        unused,
        debug_attn_mask,
    )


def flash_attention_backward_impl(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward`` through FA4."""
    grads = _backward(grad_out, query, key, value, out, logsumexp, scale, is_causal)
    if grads is None:
        return _aten._scaled_dot_product_flash_attention_backward.default(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            philox_seed,
            philox_offset,
            scale=scale,
        )
    return grads


def cudnn_attention_impl(
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
) -> tuple[Any, ...]:
    """``aten::_scaled_dot_product_cudnn_attention`` through FA4 (no bias, dropout 0).

    The log-sum-exp is returned whether or not ``compute_log_sumexp`` asks for it (FA4 computes
    it anyway; the op's meta function always promises one).
    """
    result = _forward(query, key, value, scale, is_causal)
    if result is None:
        return _aten._scaled_dot_product_cudnn_attention.default(
            query,
            key,
            value,
            attn_bias,
            compute_log_sumexp,
            dropout_p,
            is_causal,
            return_debug_mask,
            scale=scale,
        )
    out, lse = result
    # Shaped as the op's meta function gives them, which torchgraft's result checks and compiled
    # graphs hold the impl to (ATen's CUDA kernel itself allocates (1,)); unused without dropout.
    seed = torch.zeros((), dtype=torch.int64, device=query.device)
    offset = torch.zeros((), dtype=torch.int64, device=query.device)
    return (
        out,
        lse.unsqueeze(-1),
        None,
        None,
        query.shape[2],
        key.shape[2],
        seed,
        offset,
        None,
    )


def cudnn_attention_backward_impl(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::_scaled_dot_product_cudnn_attention_backward`` through FA4."""
    grads = _backward(grad_out, query, key, value, out, logsumexp.squeeze(-1), scale, is_causal)
    if grads is None:
        return _aten._scaled_dot_product_cudnn_attention_backward.default(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            philox_seed,
            philox_offset,
            attn_bias,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale=scale,
        )
    return grads
