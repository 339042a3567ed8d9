"""torchgraft's fused operators as functions, differentiable and ``torch.compile``-able.

Each runs one ``torch.ops.torchgraft.*`` custom operator (Rust kernels on CPU, CUDA C++ on CUDA)
in place of a chain of aten ops that the dispatcher cannot fuse. Importing this module defines
those operators (it needs the compiled extension); it imports no DSL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.ops.glu import custom_op as _glu  # noqa: F401  (defines the ops' autograd)
from torchgraft.ops.rope import custom_op as _rope  # noqa: F401  (defines the ops' autograd)

__all__ = ["geglu", "rope", "swiglu"]

_GELU_APPROXIMATIONS = ("none", "tanh")


def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """``F.silu(gate) * up`` in one pass (computed in float32, float64 for float64 inputs).

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        inplace_backward: Write the gradients of ``gate`` and ``up`` over ``gate`` and ``up``
            in the backward instead of allocating them (Liger-Kernel's trick: the backward
            then needs no memory of its own). Only for callers that own ``gate`` and ``up``:
            intermediate results (e.g. an MLP's fresh gate and up projections) that nothing
            reads after the backward. Autograd raises if another recorded op saved them (their
            version counter moves); leaves, tensors that do not require grad and
            non-contiguous tensors get ordinary allocated gradients. On CPU the kernel
            computes into temporaries and copies: the memory saving is on the GPU.
    """
    return torch.ops.torchgraft.swiglu(gate, up, inplace_backward=inplace_backward)


def geglu(
    gate: Tensor, up: Tensor, approximate: str = "none", *, inplace_backward: bool = False
) -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass.

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as for ``F.gelu``.
        inplace_backward: As for [`swiglu`][]: the backward writes the gradients over ``gate``
            and ``up`` (only for callers that own them and never read them afterwards).
    """
    if approximate not in _GELU_APPROXIMATIONS:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return torch.ops.torchgraft.geglu(
        gate, up, approximate == "tanh", inplace_backward=inplace_backward
    )


def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one pass: transformers'
    ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, ``rotate_half`` mapping the
    last dimension's halves ``[x1, x2]`` to ``[-x2, x1]``).

    ``cos`` and ``sin`` are unsqueezed at ``unsqueeze_dim`` and broadcast against ``q`` and
    ``k``: ``(B, S, D)`` tables with ``(B, H, S, D)`` heads (``unsqueeze_dim=1``, the default) or
    ``(B, S, H, D)`` heads (``unsqueeze_dim=2``). ``q`` and ``k`` may have different head counts
    (grouped-query attention) and any strides (e.g. transposed views of the projections): they
    are read in place. When ``cos.size(-1)`` is smaller than the head dimension, only the leading
    ``cos.size(-1)`` elements of each head are rotated and the rest pass through (partial rotary
    embeddings, as Phi-3 and GPT-NeoX apply them). The interleaved (GPT-J) convention is not
    this one.

    Each output has its input's strides when the input is dense (as eager's elementwise ops
    give), else it is contiguous. Arithmetic is in float32 (float64 for float64), each element
    rounded once; inputs of different dtypes are computed in their promoted dtype, as eager
    promotes them.

    Args:
        q: Queries, ``(..., D)``, a floating dtype.
        k: Keys, ``(..., D)``, on ``q``'s device.
        cos: Cosine table; its last size (even, at most ``D``) is the rotary dimension.
        sin: Sine table, the size of ``cos``.
        unsqueeze_dim: Where ``cos`` and ``sin`` get the dimension they broadcast over.

    Returns:
        ``(q_embed, k_embed)``, shaped like ``q`` and ``k``.
    """
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    q_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    k_dtype = torch.promote_types(k.dtype, torch.promote_types(cos.dtype, sin.dtype))
    if q.dtype == k.dtype == cos.dtype == sin.dtype:
        return torch.ops.torchgraft.rope(q, k, cos, sin, unsqueeze_dim)
    common = torch.promote_types(q_dtype, k_dtype)
    q_embed, k_embed = torch.ops.torchgraft.rope(
        q.to(common), k.to(common), cos.to(common), sin.to(common), unsqueeze_dim
    )
    return q_embed.to(q_dtype), k_embed.to(k_dtype)
