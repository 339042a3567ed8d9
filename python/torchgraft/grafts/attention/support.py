"""Which SDPA calls FlashAttention-4 can compute, read from metadata only.

The conds call :func:`decline_reason` on every call: it never touches data, never imports the
DSL, and says in words why a call stays on ATen (``torchgraft list`` and the tests read those
words). What FA4 does not do, ATen does, and ATen also raises ATen's own errors for bad input:
an inconsistent shape here is declined, never reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torchgraft.common.device import device_capability

__all__ = [
    "ARCHS",
    "DTYPES",
    "HEAD_DIMS",
    "Problem",
    "arch_name",
    "decline_reason",
    "device_capability",
    "layout_reason",
    "problem_reason",
]

#: Input dtypes FA4 computes (fp8 is forward-only and Blackwell-only there).
DTYPES = frozenset({torch.float16, torch.bfloat16})
#: Compute capability majors FA4 has kernels for that torchgraft routes to: Hopper (sm90) and
#: Blackwell (sm100). Ampere has FA4 kernels too, but FA2 (ATen's flash) is the better choice.
ARCHS = frozenset({9, 10})
#: Head dims taken (query/key and value alike). FA4 accepts multiples of 8 up to 256 on
#: Hopper; these are the ones torchgraft's GPU tests run (a dim outside falls back).
HEAD_DIMS = frozenset({64, 96, 128})

_is_cow = torch._C._is_cow_tensor


def arch_name(capability: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"sm90"``: how the crossover table names a GPU generation."""
    return f"sm{capability[0]}{capability[1]}"


@dataclass(frozen=True)
class Problem:
    """One attention call, as the support checks and the crossover table see it."""

    capability: tuple[int, int]
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    causal: bool

    @property
    def gqa(self) -> bool:
        """Fewer key/value heads than query heads (grouped-query or multi-query attention)."""
        return self.heads_kv != self.heads_q

    @classmethod
    def of(
        cls,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        is_causal: bool,
        capability: tuple[int, int],
    ) -> Problem | None:
        """The problem of a ``(batch, heads, seq, head_dim)`` call; None for other ranks, or
        for key and value shapes that do not fit the query (ATen raises for those)."""
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            return None
        batch, _, _, head_dim = query.shape
        if (
            key.shape[0] != batch
            or value.shape[0] != batch
            or key.shape[3] != head_dim
            or key.shape[1:3] != value.shape[1:3]
        ):
            return None
        return cls(
            capability=capability,
            dtype=query.dtype,
            batch=query.shape[0],
            heads_q=query.shape[1],
            heads_kv=key.shape[1],
            seq_q=query.shape[2],
            seq_k=key.shape[2],
            head_dim=query.shape[3],
            head_dim_v=value.shape[3],
            causal=bool(is_causal),
        )


def problem_reason(problem: Problem) -> str | None:
    """Why FA4 cannot compute ``problem`` (shapes, dtype, arch), or None when it can."""
    if problem.capability[0] not in ARCHS:
        return f"FA4 runs on sm90/sm100, not {arch_name(problem.capability)}"
    if problem.dtype not in DTYPES:
        return f"FA4 computes float16/bfloat16, not {problem.dtype}"
    if problem.head_dim != problem.head_dim_v or problem.head_dim not in HEAD_DIMS:
        return f"head dims {problem.head_dim}/{problem.head_dim_v} not in {sorted(HEAD_DIMS)}"
    if min(problem.batch, problem.heads_q, problem.heads_kv, problem.seq_q, problem.seq_k) <= 0:
        return "empty input"
    if problem.heads_q % problem.heads_kv:
        return f"{problem.heads_q} query heads are not a multiple of {problem.heads_kv} kv heads"
    if problem.causal and problem.seq_q != problem.seq_k:
        # SDPA's causal mask is aligned top-left, FA4's bottom-right: they differ here.
        return "causal with seq_q != seq_k (SDPA aligns the mask top-left, FA4 bottom-right)"
    return None


def layout_reason(*tensors: Tensor | None) -> str | None:
    """Why FA4 cannot read these tensors as they are laid out, or None when it can."""
    first = next(t for t in tensors if t is not None)
    for t in tensors:
        if t is None:
            continue
        if t.device != first.device:
            return "tensors on different devices"
        if t.dim() and t.stride(-1) != 1:
            return "last dim not contiguous"
        if _is_cow(t):
            # Reading a copy-on-write tensor's data pointer would materialize it.
            return "copy-on-write input"
    return None


def decline_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool,
    *extra: Tensor | None,
) -> str | None:
    """Why FA4 cannot take this call, from the tensors alone (``extra``: more tensors the
    kernel reads, e.g. ``out`` and ``grad_out`` in a backward), or None when it can."""
    if query.device.type != "cuda" or torch.version.hip is not None:
        return f"not a CUDA device ({query.device})"
    if not (key.dtype == value.dtype == query.dtype):
        return "query, key and value dtypes differ"
    reason = layout_reason(query, key, value, *extra)
    if reason is not None:
        return reason
    problem = Problem.of(query, key, value, is_causal, device_capability(query.device.index))
    if problem is None:
        return "not matching (batch, heads, seq, head_dim) tensors"
    return problem_reason(problem)
