"""The RoPE benchmark: transformers' ``apply_rotary_pos_emb`` on q and k with grouped-query heads.

q ``(batch, heads, seq, dim)`` and k ``(batch, kv_heads, seq, dim)`` are transposed views of the
``(batch, seq, heads * dim)`` projections, as a Llama attention layer makes them; cos and sin are
``(batch, seq, dim)`` rotary tables (base 10000). Forward + backward differentiates to the
projections. Routes: the eager formula, torch.compile of it, torchgraft's fused op
(``torchgraft.functional.rope``) and Liger-Kernel's ``liger_rotary_pos_emb`` (which rotates q
and k in place: every route gets its own copy of the projections).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from torchgraft.ops.rope.reference import rotate_half

from .fused_common import (
    ELEMENTWISE_PASSES,
    TOLERANCE,
    TORCHGRAFT_GRAFTS,
    compiled,
    default_dtype,
    liger_attr,
    liger_unavailable,
    make_generator,
    randn,
    torchgraft_unavailable,
)
from .problem import ShapedProblem
from .routes import Route, always_available, stock_dispatch

__all__ = [
    "BASELINE",
    "MODES",
    "OP",
    "PASSES",
    "PEAK_MEMORY",
    "TOLERANCE",
    "Inputs",
    "Problem",
    "RopeFn",
    "bytes_moved",
    "check_shape",
    "default_dtype",
    "default_shapes",
    "llama_rope",
    "make_inputs",
    "reference",
    "rope_tables",
    "routes",
    "run_once",
    "timed_call",
]

OP = "rope"
OP_SYMBOLS = ("mul", "add", "cat", "neg")
"""The aten ops of the eager formula (torch._native's overrides of them are kept off)."""
MODES = ("fwd", "fwd+bwd")
"""``fwd``: the forward alone; ``fwd+bwd``: forward, then backward to the q and k projections."""
PASSES = ELEMENTWISE_PASSES
BASELINE = "eager"
"""The route the table's speedups are against."""
PEAK_MEMORY = False
"""Whether each call's extra peak memory is recorded (CUDA only)."""
ROPE_BASE = 10000.0

RopeFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``fn(q, k, cos, sin) -> (q_embed, k_embed)``, tables unsqueezed at dim 1."""


@dataclass(frozen=True)
class Problem(ShapedProblem):
    """One benchmark problem: ``(batch, seq, heads, kv_heads, dim)``, dtype, device."""

    @property
    def batch(self) -> int:
        """Sequences per batch."""
        return self.shape[0]

    @property
    def seq(self) -> int:
        """Tokens per sequence."""
        return self.shape[1]

    @property
    def heads(self) -> int:
        """Query heads."""
        return self.shape[2]

    @property
    def kv_heads(self) -> int:
        """Key (and value) heads: fewer than ``heads`` under grouped-query attention."""
        return self.shape[3]

    @property
    def dim(self) -> int:
        """Head dimension (all of it rotated)."""
        return self.shape[4]


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """The sweep run when ``--shapes`` is not given: head dim 64 and 128, 32 query and 8
    key-value heads, 2 x 4096 tokens on CUDA (smaller on the CPU)."""
    if device.type == "cpu":
        tokens, heads, kv_heads = (64, 8, 2) if quick else (1024, 32, 8)
        return [(2, tokens, heads, kv_heads, dim) for dim in (64, 128)]
    return [(2, 4096, 32, 8, dim) for dim in (64, 128)]


def check_shape(shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` is not ``batch x seq x heads x kv_heads x dim``, or None."""
    if len(shape) != 5:
        return "expected batch x seq x heads x kv_heads x dim, e.g. 2x4096x32x8x128"
    if shape[4] % 2:
        return f"the head dim must be even, got {shape[4]}"
    return None


def bytes_moved(problem: Problem, mode: str) -> int:
    """Bytes an ideal kernel moves: q and k read and written, cos and sin read once; the
    backward moves as much again (the gradients of q and k read and written, the tables)."""
    item = problem.dtype.itemsize
    heads = problem.batch * problem.seq * (problem.heads + problem.kv_heads) * problem.dim
    tables = 2 * problem.batch * problem.seq * problem.dim
    forward = (2 * heads + tables) * item
    return forward if mode == "fwd" else 2 * forward


# ---- inputs, reference, running a route --------------------------------------------------------


def rope_tables(
    batch: int, seq: int, dim: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of shape ``(batch, seq, dim)`` for positions ``0..seq-1``, as Llama's
    rotary embedding makes them (frequencies ``base ** (-2i / dim)``, each half repeated)."""
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2, device=device).float() / dim))
    freqs = torch.arange(seq, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(batch, -1, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def llama_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' Llama ``apply_rotary_pos_emb`` (tables unsqueezed at dim 1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@dataclass(frozen=True)
class Inputs:
    """The q and k projections ``(batch, seq, heads * dim)``, the tables, output gradients."""

    problem: Problem
    q_proj: Tensor
    k_proj: Tensor
    cos: Tensor
    sin: Tensor
    grad_q: Tensor
    grad_k: Tensor

    @property
    def x(self) -> Tensor:
        """The tensor whose copy is timed as the bandwidth ceiling (the q projection)."""
        return self.q_proj

    def heads(self, q_proj: Tensor, k_proj: Tensor) -> tuple[Tensor, Tensor]:
        """q ``(batch, heads, seq, dim)`` and k as transposed views of the projections."""
        p = self.problem
        q = q_proj.view(p.batch, p.seq, p.heads, p.dim).transpose(1, 2)
        k = k_proj.view(p.batch, p.seq, p.kv_heads, p.dim).transpose(1, 2)
        return q, k


def make_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """Random projections and output gradients, the rotary tables of positions 0..seq-1."""
    gen = make_generator(problem.device, seed)
    p, dtype, device = problem, problem.dtype, problem.device
    cos, sin = rope_tables(p.batch, p.seq, p.dim, dtype, device)
    return Inputs(
        problem=p,
        q_proj=randn((p.batch, p.seq, p.heads * p.dim), dtype, device, gen),
        k_proj=randn((p.batch, p.seq, p.kv_heads * p.dim), dtype, device, gen),
        cos=cos,
        sin=sin,
        grad_q=randn((p.batch, p.heads, p.seq, p.dim), dtype, device, gen),
        grad_k=randn((p.batch, p.kv_heads, p.seq, p.dim), dtype, device, gen),
    )


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[q_embed, k_embed]``, then the projections' gradients."""
    q_proj = inputs.q_proj.detach().double().requires_grad_(mode != "fwd")
    k_proj = inputs.k_proj.detach().double().requires_grad_(mode != "fwd")
    q_embed, k_embed = llama_rope(
        *inputs.heads(q_proj, k_proj), inputs.cos.double(), inputs.sin.double()
    )
    if mode == "fwd":
        return [q_embed.detach(), k_embed.detach()]
    grads = torch.autograd.grad(
        (q_embed, k_embed), (q_proj, k_proj), (inputs.grad_q.double(), inputs.grad_k.double())
    )
    return [q_embed.detach(), k_embed.detach(), *grads]


def _own_copies(inputs: Inputs, mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Every route gets its own projections and output gradients: Liger rotates q and k (and,
    # in its backward, the gradients) in place.
    q_proj, k_proj = inputs.q_proj.clone(), inputs.k_proj.clone()
    if mode != "fwd":
        q_proj.requires_grad_()
        k_proj.requires_grad_()
    return q_proj, k_proj, inputs.grad_q.clone(), inputs.grad_k.clone()


def run_once(fn: RopeFn, inputs: Inputs, mode: str) -> list[Tensor]:
    """The route's results for ``mode``, in the order :func:`reference` returns them."""
    q_proj, k_proj, grad_q, grad_k = _own_copies(inputs, mode)
    if mode == "fwd":
        with torch.no_grad():
            return list(fn(*inputs.heads(q_proj, k_proj), inputs.cos, inputs.sin))
    q_embed, k_embed = fn(*inputs.heads(q_proj, k_proj), inputs.cos, inputs.sin)
    outs = [q_embed.detach().clone(), k_embed.detach().clone()]
    grads = torch.autograd.grad((q_embed, k_embed), (q_proj, k_proj), (grad_q, grad_k))
    return [*outs, *grads]


def timed_call(fn: RopeFn, inputs: Inputs, mode: str) -> Callable[[], object]:
    """A no-argument callable running ``mode`` once (what the timer calls): q and k are made
    as views of the projections inside it, as the attention layer makes them. An in-place
    route is timed on its previous call's output, which costs the same."""
    q_proj, k_proj, grad_q, grad_k = _own_copies(inputs, mode)
    cos, sin = inputs.cos, inputs.sin
    if mode == "fwd":

        def forward() -> object:
            with torch.no_grad():
                return fn(*inputs.heads(q_proj, k_proj), cos, sin)

        return forward

    def forward_backward() -> object:
        outs = fn(*inputs.heads(q_proj, k_proj), cos, sin)
        return torch.autograd.grad(outs, (q_proj, k_proj), (grad_q, grad_k))

    return forward_backward


# ---- the routes ------------------------------------------------------------------------------


def _build_eager(_problem: Problem) -> RopeFn:
    return llama_rope


def _build_compile(_problem: Problem) -> RopeFn:
    return compiled(llama_rope)


def _build_torchgraft(_problem: Problem) -> RopeFn:
    from torchgraft import functional as tgf

    return tgf.rope


def _build_liger(_problem: Problem) -> RopeFn:
    liger_rotary_pos_emb = liger_attr("transformers.rope", "liger_rotary_pos_emb")

    def liger(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        q_embed, k_embed = tuple(liger_rotary_pos_emb(q, k, cos, sin))[:2]
        return q_embed, k_embed

    return liger


def routes() -> tuple[Route, ...]:
    """Every RoPE route, in table order (the eager baseline first). All run with torchgraft's
    grafts off: the torchgraft route calls its operator directly."""
    stock = functools.partial(stock_dispatch, OP_SYMBOLS)
    return (
        Route(
            "eager",
            "transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, same for k",
            always_available,
            _build_eager,
            stock,
        ),
        Route(
            "compile",
            "torch.compile of the eager formula (static shapes)",
            always_available,
            _build_compile,
            stock,
        ),
        Route(
            "torchgraft",
            "torchgraft.functional.rope: q and k in one kernel each way, read in place",
            torchgraft_unavailable,
            _build_torchgraft,
            stock,
            graft_prefix=TORCHGRAFT_GRAFTS,
        ),
        Route(
            "liger",
            "Liger-Kernel's liger_rotary_pos_emb (rotates q and k in place)",
            liger_unavailable,
            _build_liger,
            stock,
        ),
    )
