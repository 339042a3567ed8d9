"""FlashAttention-4's CuteDSL kernels (flash-attn-4, module ``flash_attn.cute``), called in
their own layout.

Importing this module imports FA4 and with it CuteDSL; the impls import it on their first call
(through :class:`torchgraft.dsl.lazy.LazyKernels`), never at registration. FA4 compiles a
kernel the first time it meets a new configuration (head dim, causal, GQA packing, dtype),
which takes seconds; ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps the compiled kernels
on disk across processes.

Tensors here are ``(batch, seq, heads, head_dim)``, FA4's layout: the SDPA ops' ``(batch,
heads, seq, head_dim)`` tensors transposed, as views. ``lse`` is ``(batch, heads, seq_q)``
float32, natural log, as ATen's flash attention returns it.
"""

from __future__ import annotations

import torch
from flash_attn.cute import interface as _fa4
from torch import Tensor

__all__ = ["backward", "forward"]


def forward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float | None, causal: bool
) -> Tensor:
    """Attention of ``q`` over ``k``/``v`` written into ``out``; returns the log-sum-exp.

    ``scale`` None means ``1/sqrt(head_dim)``, as in SDPA.
    """
    result = _fa4._flash_attn_fwd(
        q, k, v, softmax_scale=scale, causal=causal, return_lse=True, out=out
    )
    written, lse = result[0], result[1]
    if written is not out:  # FA4 writes into a given out; copy if a version does not
        out.copy_(written)
    return lse


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, shaped like ``q``, ``k``, ``v`` (dk and dv summed over a GQA group).

    Deterministic (FA4's semaphore-ordered accumulation) when
    ``torch.use_deterministic_algorithms(True)`` is in effect.
    """
    result = _fa4._flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=scale,
        causal=causal,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return result[0], result[1], result[2]
