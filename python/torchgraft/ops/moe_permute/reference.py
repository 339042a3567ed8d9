"""MoE token permutation in torch's own ops: the definition the kernels follow, what calls
they do not take run, and what the tests compare with.

Notation: ``T`` tokens, ``K = top_k`` experts each, ``S = T * K`` pairs, pair ``p = t * K + k``.
``perm`` ``(S,)``: slot ``s`` holds pair ``perm[s]`` (pairs in expert order); ``inv_perm``: pair
``p`` sits at slot ``inv_perm[p]``; ``valid``: a one-element integer tensor, the number of slots
holding a real expert (slots at or beyond it hold pairs of experts this rank does not have,
"sentinels" under expert parallelism: zero rows, counted for nothing). ``valid`` is read on the
device (compared, never ``.item()``), so nothing here waits for the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "inverse_permutation",
    "moe_permute_reference",
    "moe_sort_reference",
    "moe_unpermute_reference",
]


def inverse_permutation(perm: Tensor) -> Tensor:
    """The inverse of the permutation ``perm`` ``(S,)`` of ``0..S``: ``inv[perm[s]] = s``
    (a scatter of distinct indices: deterministic, no host synchronisation)."""
    positions = torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype)
    return torch.empty_like(perm).scatter_(0, perm, positions)


def _real_slots(slots: Tensor, valid: Tensor) -> Tensor:
    """Which of ``slots`` hold a real expert: ``slot < valid``."""
    return slots < valid.reshape(())


def _check_top_k(op: str, top_k: int) -> None:
    if top_k < 1:
        raise RuntimeError(f"{op}: top_k must be at least 1, got {top_k}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums happen: float32 (float64 for float64); other dtypes in their own."""
    if not dtype.is_floating_point:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def moe_permute_reference(hidden: Tensor, perm: Tensor, valid: Tensor, top_k: int) -> Tensor:
    """``out[s] = hidden[perm[s] // top_k]`` for ``s < valid``, zero beyond: ``(S, H)`` of
    ``hidden``'s dtype. Differentiable with respect to ``hidden``."""
    _check_top_k("moe_permute", top_k)
    rows = hidden.index_select(0, torch.div(perm, top_k, rounding_mode="floor"))
    slots = torch.arange(perm.shape[0], device=perm.device)
    keep = _real_slots(slots, valid).unsqueeze(-1)
    return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def moe_unpermute_reference(
    y: Tensor, inv_perm: Tensor, valid: Tensor, weights: Tensor | None, top_k: int
) -> Tensor:
    """``out[t] = sum_k w[t, k] * y[inv_perm[t * top_k + k]]`` over the pairs whose slot is
    below ``valid`` (``w = 1`` without weights): ``(T, H)``, summed in float32 (float64 for
    float64) and rounded once to ``y``'s dtype. transformers' ``weighted_out[inv_perm].view(T,
    K, H).sum(1)`` with the routing weights applied before the gather. Differentiable with
    respect to ``y`` and ``weights``."""
    _check_top_k("moe_unpermute", top_k)
    pairs, width = y.shape
    acc = _acc_dtype(y.dtype)
    rows = y.index_select(0, inv_perm).to(acc)
    if weights is not None:
        rows = rows * weights.reshape(pairs, 1).to(acc)
    keep = _real_slots(inv_perm, valid).unsqueeze(-1)
    rows = torch.where(keep, rows, torch.zeros((), dtype=acc, device=rows.device))
    return rows.view(pairs // top_k, top_k, width).sum(1).to(y.dtype)


def moe_sort_reference(
    expert_ids: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pairs of ``expert_ids`` ``(T, K)`` grouped by expert, on their device with torch's
    ops (no host synchronisation; CUDA-graph and ``torch.compile`` safe).

    Returns ``(perm, inv_perm, offsets, valid)``: ``perm`` ``(S,)`` int64, the pairs in expert
    order (a stable sort: within an expert, pairs in token order); ``inv_perm`` its inverse;
    ``offsets`` ``(E,)`` int32, the end of each expert's slots (what ``torch._grouped_mm``
    takes as ``offs``); ``valid`` ``(1,)`` int32, ``offsets[-1:]``. Ids outside
    ``[0, num_experts)`` (experts of other ranks under expert parallelism) sort last and are
    counted in no expert: their slots are the sentinels at or beyond ``valid``.
    """
    if num_experts < 1:
        raise ValueError(f"moe_sort: num_experts must be at least 1, got {num_experts}")
    flat = expert_ids.reshape(-1)
    local = (flat >= 0) & (flat < num_experts)
    keys = torch.where(local, flat, torch.full_like(flat, num_experts))
    sorted_keys, perm = torch.sort(keys, stable=True)
    # The slots of experts 0..e: the sorted keys below e + 1 (a search, not a histogram:
    # no atomics, the same under CUDA graphs).
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=keys.dtype)
    offsets = torch.searchsorted(sorted_keys, bounds, out_int32=True)
    return perm, inverse_permutation(perm), offsets, offsets[-1:]
