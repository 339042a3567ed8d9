"""Mixture-of-experts expert blocks: the token permutation around the grouped GEMMs, and the
gating between them, routed to ``torchgraft.functional``.

transformers' experts classes (``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts`` and
every class decorated with ``use_experts_implementation``) hold the experts as 3-D parameters,
``gate_up_proj`` ``(experts, 2 * intermediate, hidden)`` and ``down_proj`` ``(experts, hidden,
intermediate)`` (transposed where ``is_transposed``), and compute, for the ``k`` experts of each
token, ``down(act(gate) * up)`` weighted by the routing weights and summed per token. Their
``grouped_mm`` implementation sorts the (token, expert) pairs by expert, gathers the hidden rows
in that order, masks rows of out-of-range experts three times forward and three times backward,
and puts the rows back with an index and a sum; its gather's backward is an accumulating
``index_put_``. The replacement computes the same with:

- ``functional.moe_sort``: the pairs in expert order, their inverse, the per-expert offsets and
  the count of pairs with a real expert, on the device (no host sync);
- ``functional.moe_permute``: the gather, whose backward sums each token's rows in one pass
  (the gathered rows are not kept for the first GEMM's weight gradient: the backward gathers
  them again, ``common.recompute``);
- the grouped GEMMs the model itself calls (transformers' ``_grouped_mm``: ``torch``'s grouped
  GEMM where it applies, transformers' fallback elsewhere), and the block's own gating between
  them (``self._apply_gate``: its activation module, GPT-OSS's clamped variant alike);
- ``functional.moe_unpermute``: weights applied and rows summed per token in one pass
  (float32 accumulation), forward and backward.

Rows of out-of-range experts (expert parallelism's sentinels) are never read as values: the
permutation ops count them as zero, so no mask is needed.

Adopted where the block has a gate projection (``[gate; up]`` concatenated, or interleaved as
GPT-OSS's: the block's own gating reads either), with or without biases (GPT-OSS: each slot's
expert bias added after each grouped GEMM, as transformers does), and the model runs one of
transformers' own implementations (``grouped_mm``, ``batched_mm``, ``eager``); every candidate
is probed against its own forward with random experts, weights and routing, forward and
backward. The gating between the GEMMs is ``functional.swiglu_packed`` (one pass over the
concatenated ``[gate; up]`` layout without biases, its gradient written over that
intermediate; its output is made again in the backward rather than kept) where the block uses
transformers' default gating with an activation the probe finds to be SiLU, and no hooks would
be skipped; the block's own ``_apply_gate`` otherwise (GPT-OSS's clamped gating, other
activations, hooks on ``act_fn``: checked on every call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from torchgraft.adopt import guard
from torchgraft.adopt.base import Candidate, Context, Variant
from torchgraft.adopt.probe import Case, random_tensor, swapped_parameters, training_mode
from torchgraft.adopt.report import SKIPPED
from torchgraft.common.recompute import recomputed

OP = "torchgraft::moe_permute"
"""The operator the switches name for this row (``disable_op("moe_permute")`` turns it off)."""
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
"""transformers' own experts implementations: they compute what the replacement computes. Any
other choice (``sonicmoe``, ``deepgemm``, a registered kernel) is the user's and is kept."""
_OPS = ("moe_sort", "moe_permute", "moe_unpermute")

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verified:
    """What an adopted experts block was verified with (re-checked on each call)."""

    implementation: str | None
    layout: tuple[object, ...]
    """``(has_gate, has_bias, is_concatenated, is_transposed)``."""
    dtypes: frozenset[tuple[torch.dtype, torch.dtype]]
    """(hidden, routing weights) dtype pairs the probe covered."""


def _variant(
    ops: tuple[Callable[..., object], ...],
    grouped_mm: GroupedMM,
    swiglu: tuple[Callable[..., torch.Tensor], type] | None = None,
) -> Variant:
    """The replacement forward; with ``swiglu`` (``functional.swiglu_packed`` and the
    activation class it was verified against), the gating fused on the ``[gate; up]`` layout
    wherever it computes what the block's own gating would (see :func:`_fused_gate_applies`)."""
    sort, permute, unpermute = ops
    # Looked up here, not in the forward: torch.compile (2.11) cannot trace the import.
    default_gate = _default_apply_gate()

    def grouped_linear(
        x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, t: bool
    ) -> torch.Tensor:
        # As transformers: the input in the weight's dtype, the weight (experts, in, out).
        return grouped_mm(x.to(weight.dtype), weight if t else weight.transpose(-2, -1), offsets)

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        perm, inv_perm, offsets, valid = sort(top_k_index, self.num_experts)  # type: ignore[misc]
        rows = permute(hidden_states, perm, valid, top_k)
        # The permuted rows (top_k copies of the input) are gathered again for the weight
        # gradient instead of kept: the input stays alive anyway (the router saved it).
        again = functools.partial(permute, hidden_states, perm, valid, top_k)
        with recomputed(rows, again, (hidden_states, perm, valid)):
            gate_up = grouped_linear(rows, self.gate_up_proj, offsets, self.is_transposed)
        experts = _slot_experts(top_k_index, perm, self.num_experts) if self.has_bias else None
        if experts is not None:
            gate_up = gate_up + _per_slot(self.gate_up_proj_bias, experts)
        if swiglu is not None and _fused_gate_applies(self, swiglu[1], default_gate):
            # gate_up is this forward's own intermediate: its gradient may overwrite it.
            gated = swiglu[0](gate_up, inplace_backward=True)
            # The gated rows are made again from gate_up for the down GEMM's weight gradient,
            # which the backward computes before the gating's gradient overwrites gate_up.
            again = functools.partial(swiglu[0], gate_up, inplace_backward=False)
            with recomputed(gated, again, (gate_up,)):
                out = grouped_linear(gated, self.down_proj, offsets, self.is_transposed)
        else:
            gated = self._apply_gate(gate_up)
            out = grouped_linear(gated, self.down_proj, offsets, self.is_transposed)
        if experts is not None:
            out = out + _per_slot(self.down_proj_bias, experts)
        summed = unpermute(out, inv_perm, valid, top_k_weights, top_k)
        return summed.to(hidden_states.dtype)  # type: ignore[union-attr]

    if swiglu is None:
        forward.__qualname__ = "moe_experts[grouped].forward"
        return Variant("grouped, the model's gating", OP, forward, fallback=True)
    forward.__qualname__ = "moe_experts[grouped, swiglu_packed].forward"
    return Variant("grouped, fused SwiGLU", OP, forward)


def _slot_experts(top_k_index: torch.Tensor, perm: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert of each slot (pairs in expert order); ``num_experts`` for another rank's."""
    ids = top_k_index.reshape(-1)[perm]
    local = (ids >= 0) & (ids < num_experts)
    return torch.where(local, ids, num_experts)


def _per_slot(bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each slot's expert bias, ``(slots, out)``. Another rank's slots read an appended zero
    row: the grouped GEMMs leave those rows unwritten, forward and in the backward, and what
    reaches them lands in that row, not in a real expert's bias gradient."""
    return nn.functional.pad(bias, (0, 0, 0, 1))[experts]


def _fused_gate_applies(module: nn.Module, activation: type, default_gate: object) -> bool:
    """Whether ``swiglu_packed`` computes what ``module._apply_gate`` would, and nothing runs
    around it that the fused op would skip: the ``[gate; up]`` layout without biases,
    transformers' default gating (``default_gate``), the activation class verified on the
    probe, no hooks on it and no global module hooks. Plain attribute and dict reads, on every
    call."""
    act = module._modules.get("act_fn")
    return (
        act is not None
        and type(act) is activation
        and module.is_concatenated
        and not module.has_bias
        and "_apply_gate" not in module.__dict__
        and getattr(type(module), "_apply_gate", None) is default_gate
        and not (act._forward_hooks or act._forward_pre_hooks)
        and not guard.global_hooks()
    )


@functools.cache
def _default_apply_gate() -> object:
    """transformers' default gating (``chunk(2, -1)``, then ``act_fn(gate) * up``)."""
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)


class MoEExpertsAdopter:
    """transformers' experts blocks (``use_experts_implementation``), found by structure."""

    kind = "moe_experts"
    finds = "3-D gate_up_proj and down_proj, int num_experts, transformers' layout flags"

    def __init__(self) -> None:
        self._variants: dict[tuple[object, ...], Variant] = {}

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            if id(module) not in ctx.claimed and _is_experts(module):
                ctx.claimed.update(id(m) for m in module.modules())
                yield self._candidate(path, module, ctx)

    def _candidate(self, path: str, module: nn.Module, ctx: Context) -> Candidate:
        c = Candidate(self.kind, path, type(module).__name__, module, "forward", "forward")
        plan = _plan(module, ctx)
        if isinstance(plan, str):
            c.status, c.reason = SKIPPED, plan
            return c
        ops, grouped_mm, swiglu = plan
        keys: list[tuple[object, ...]] = [(ops, grouped_mm, None)]
        act = module._modules.get("act_fn")
        if swiglu is not None and _fused_gate_applies(module, type(act), _default_apply_gate()):
            keys.insert(0, (ops, grouped_mm, (swiglu, type(act))))
        for key in keys:
            if key not in self._variants:
                self._variants[key] = _variant(*key)  # type: ignore[arg-type]
        dtypes = _dtype_pairs(module)
        c.own = module.forward
        c.variants = tuple(self._variants[key] for key in keys)
        c.cases = functools.partial(_cases, module, dtypes)
        c.run = functools.partial(_run, module)
        c.preference_key = (self.kind, type(module))
        c.check = recheck
        c.verified = Verified(_implementation(module), _layout(module), frozenset(dtypes))
        return c


Plan = tuple[tuple[Callable[..., object], ...], GroupedMM, Callable[..., torch.Tensor] | None]


def _plan(module: nn.Module, ctx: Context) -> Plan | str:
    """The functions the replacement calls (the permutation ops, the grouped GEMM, the packed
    SwiGLU where this build has it), or why the block is not adopted."""
    why = _not_plain(module)
    if why:
        return why
    grouped_mm, why = _grouped_mm()
    if grouped_mm is None:
        return why
    found = []
    for name in _OPS:
        fn, missing = ctx.functional_op(name)
        if fn is None:
            return missing
        found.append(fn)
    swiglu, _ = ctx.functional_op("swiglu_packed")
    return tuple(found), grouped_mm, swiglu  # type: ignore[return-value]


def recheck(
    module: nn.Module, verified: Verified, args: tuple[object, ...], kwargs: dict[str, object]
) -> str:
    """Why this call must run the block's own forward (empty: the replacement may serve it)."""
    if _implementation(module) != verified.implementation:
        return f"experts implementation is now {_implementation(module)!r}"
    if _layout(module) != verified.layout:
        return "its layout flags (has_gate, has_bias, is_concatenated, is_transposed) changed"
    if kwargs or len(args) != 3 or not all(isinstance(a, torch.Tensor) for a in args):
        return "called with other arguments than (hidden_states, top_k_index, top_k_weights)"
    hidden, index, weights = args
    assert isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor)
    assert isinstance(weights, torch.Tensor)
    if hidden.dim() != 2 or index.dim() != 2 or index.dtype != torch.int64:
        return "inputs are not (tokens, hidden) states and (tokens, k) int64 experts"
    if (hidden.dtype, weights.dtype) not in verified.dtypes:
        return f"states {hidden.dtype} with weights {weights.dtype} were not verified"
    return ""


def _is_experts(module: nn.Module) -> bool:
    params = module._parameters
    return (
        all(_is_3d(params.get(n)) for n in ("gate_up_proj", "down_proj"))
        and isinstance(getattr(module, "num_experts", None), int)
        and all(isinstance(getattr(module, f, None), bool) for f in _FLAGS)
    )


def _is_3d(p: object) -> bool:
    return isinstance(p, torch.Tensor) and p.dim() == 3


def _is_2d(p: object) -> bool:
    return isinstance(p, torch.Tensor) and p.dim() == 2


_FLAGS = ("has_gate", "has_bias", "is_concatenated", "is_transposed")


def _layout(module: nn.Module) -> tuple[object, ...]:
    return tuple(getattr(module, f, None) for f in _FLAGS)


def _implementation(module: nn.Module) -> str | None:
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


_BIASES = {"gate_up_proj_bias", "down_proj_bias"}


def _not_plain(module: nn.Module) -> str:
    """Why the block's layout is not one the replacement computes ("" when it is): a gate
    projection (``[gate; up]`` concatenated or interleaved: the block's own gating reads
    either), biases or none, transformers' own implementation, and nothing else."""
    has_gate, has_bias, _, _ = _layout(module)
    if not has_gate:
        return "experts without a gate projection"
    if not callable(getattr(module, "_apply_gate", None)):
        return "no _apply_gate (transformers' gating)"
    params = {"gate_up_proj", "down_proj"} | (_BIASES if has_bias else set())
    if set(module._parameters) != params:
        flag = "has_bias" if has_bias else "no has_bias"
        return f"parameters other than gate_up_proj, down_proj and the biases {flag} says"
    if has_bias and not all(_is_2d(module._parameters[n]) for n in _BIASES):
        return "biases that are not (experts, features) matrices"
    if set(module._modules) - {"act_fn"}:
        return "children besides act_fn"
    implementation = _implementation(module)
    if implementation not in IMPLEMENTATIONS:
        return f"experts implementation {implementation!r} chosen: left in place"
    if module.gate_up_proj.is_meta:
        return "parameters on the meta device: load the weights first"
    return ""


def _grouped_mm() -> tuple[GroupedMM | None, str]:
    """transformers' grouped GEMM (the one its ``grouped_mm`` implementation calls: torch's
    kernel where it applies, its own fallback elsewhere)."""
    try:
        from transformers.integrations.moe import _grouped_mm as grouped_mm
    except ImportError:
        return None, "transformers has no grouped_mm (transformers.integrations.moe)"
    return grouped_mm, ""


def _dtype_pairs(module: nn.Module) -> list[tuple[torch.dtype, torch.dtype]]:
    """(hidden, routing weights) dtypes to probe: float32, and the module's own dtype with
    routing weights in that dtype (Qwen's routers) and in float32 (Mixtral's)."""
    own = module.gate_up_proj.dtype
    return list(dict.fromkeys([(torch.float32, torch.float32), (own, own), (own, torch.float32)]))


def _cases(module: nn.Module, dtypes: list[tuple[torch.dtype, torch.dtype]]) -> list[Case]:
    """Random tokens, experts (distinct per token), routing and expert weights, in each dtype
    pair; gradients of the states, the weights and both projections."""
    experts = module.num_experts
    gen = torch.Generator().manual_seed(0)
    device = module.gate_up_proj.device
    tokens, top_k = 2 * experts + 3, min(2, experts)
    cases = []
    for dtype, w_dtype in dtypes:
        hidden = random_tensor((tokens, _hidden_size(module)), gen, dtype, device)
        hidden.requires_grad_(True)
        index = torch.rand((tokens, experts), generator=gen).argsort(dim=-1)[:, :top_k]
        # The weights' leaf in the states' dtype when that is narrower: the gradient of float32
        # weights of a bfloat16 block carries bfloat16's precision, and is compared at it.
        leaf_dtype = dtype if dtype.itemsize < w_dtype.itemsize else w_dtype
        leaf = random_tensor((tokens, top_k), gen, torch.float32, device).abs() + 0.1
        leaf = leaf.to(leaf_dtype).requires_grad_(True)
        weights = leaf.to(w_dtype)
        params = {
            name: nn.Parameter(random_tensor(tuple(p.shape), gen, dtype, device, scale=0.5))
            for name, p in module._parameters.items()
            if p is not None
        }
        cases.append(
            Case(
                f"states {_short(dtype)}, weights {_short(w_dtype)}",
                (hidden, index.to(device), weights),
                leaves=(hidden, leaf, *params.values()),
                params=params,
                training=True,
            )
        )
    return cases


def _hidden_size(module: nn.Module) -> int:
    # gate_up_proj is (experts, 2 * intermediate, hidden), or (experts, hidden, 2 * ...) transposed
    return module.gate_up_proj.shape[1 if module.is_transposed else 2]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    with swapped_parameters(module, case.params), training_mode(module, case.training):
        return fn(*case.args, **case.kwargs)
