"""Rotary position embeddings: transformers' module-global ``apply_rotary_pos_emb`` (hub tag
``rotary_pos_emb``), routed to ``torchgraft.functional.rope``.

transformers' attention layers call the function by its global name in their modeling module, so
the replacement is installed there, for the whole process, while at least one adopted model holds
it (see :mod:`torchgraft.adopt.slots`).

Partial rotary embeddings (GPT-NeoX, Phi-3 with ``partial_rotary_factor``, Qwen3-Next...) pass
``cos``/``sin`` narrower than the head: the model's function rotates the leading
``cos.size(-1)`` elements and passes the rest through, as ``torchgraft.functional.rope`` does.
Where the model's function accepts such calls, the probe includes them, and the replacement routes
them to the op only where it agreed there too; otherwise partial calls keep the model's function,
and a model whose config asks for partial rotary reports RoPE as skipped (no kernel would run).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchgraft.adopt import slots
from torchgraft.adopt.base import Candidate, Context, Variant
from torchgraft.adopt.probe import Case, random_tensor
from torchgraft.adopt.report import SKIPPED

FUNCTION = "apply_rotary_pos_emb"
PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
PARTIAL_NOTE = "partial rotary too"
FULL_ONLY_NOTE = "partial-rotary calls run the model's own function"


def _replacement(
    own: Callable[..., object], rope: Callable[..., object], cast: bool, partial: bool
) -> Callable[..., object]:
    """``rope`` where the call is full width (``cos`` as wide as the heads) or, with
    ``partial``, narrower; ``own`` otherwise. ``cast``: return q's and k's own dtypes (as
    OLMo2's function does) instead of the promoted one (Llama's)."""

    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> object:
        width, head = cos.shape[-1], q.shape[-1]
        if head != k.shape[-1] or (width != head and not (partial and width < head)):
            return own(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        q_embed, k_embed = rope(q, k, cos, sin, unsqueeze_dim)
        if cast:
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed

    apply_rotary_pos_emb.__qualname__ = f"rope[{getattr(own, '__module__', '')}].{FUNCTION}"
    apply_rotary_pos_emb.partial = partial  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


class RopeAdopter:
    """``apply_rotary_pos_emb`` in the modeling modules of a model's layers."""

    kind = "rope"
    finds = "module-global apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        seen: set[str] = set()
        partial = partial_rotary(model)
        for module in model.modules():
            name = type(module).__module__
            pymod = sys.modules.get(name)
            if name in seen or pymod is None or not callable(getattr(pymod, FUNCTION, None)):
                continue
            seen.add(name)
            yield self._candidate(pymod, partial, ctx)

    def _candidate(self, pymod: types.ModuleType, partial: str, ctx: Context) -> Candidate:
        own = getattr(pymod, FUNCTION)
        base = Candidate(
            self.kind, f"{pymod.__name__}.{FUNCTION}", FUNCTION, pymod, FUNCTION, "global"
        )
        held = slots.held_global(pymod, FUNCTION)
        if held is not None and own is held[1]:
            # Another adopted model installed (and verified) it: hold it too.
            routes_partial = getattr(own, "partial", False)
            if partial and not routes_partial:
                base.status, base.reason = SKIPPED, _no_partial_route(partial)
                return base
            name = getattr(own, "variant", "rotate_half")
            note = PARTIAL_NOTE if routes_partial else FULL_ONLY_NOTE
            base.variants = (Variant(name, "torchgraft::rope", own, note=note),)
            return base
        if held is not None and own is not held[0]:
            base.status = SKIPPED
            base.reason = f"{pymod.__name__}.{FUNCTION} was replaced by someone else: left in place"
            return base
        if held is not None:
            own = held[0]  # the original, put back meanwhile: verify and hold again
        if not _plain_signature(own):
            base.status, base.reason = SKIPPED, f"signature is not ({', '.join(PARAMETERS)}=1)"
            return base
        rope, missing = ctx.functional_op("rope")
        if rope is None:
            base.status, base.reason = SKIPPED, missing
            return base
        accepts_partial = _accepts_partial(own)
        if partial and not accepts_partial:
            base.status, base.reason = SKIPPED, _no_partial_route(partial)
            return base
        base.own = own
        base.variants = tuple(
            _variant(own, rope, cast, routes, accepts_partial)
            for routes in ((True, False) if accepts_partial else (False,))
            # A model with partial rotary takes only variants that route its calls.
            if routes or not partial
            for cast in (False, True)
        )
        base.cases = lambda: _cases(partial=accepts_partial)
        base.run = lambda fn, case: fn(*case.args, **case.kwargs)
        return base


def _variant(
    own: Callable[..., object],
    rope: Callable[..., object],
    cast: bool,
    routes_partial: bool,
    accepts_partial: bool,
) -> Variant:
    """Routing partial calls to the op is preferred; keeping them on the model's function is
    the fallback for a function whose partial calls the op does not compute as it does."""
    name = "rotate_half, in q's and k's dtypes" if cast else "rotate_half"
    function = _replacement(own, rope, cast, routes_partial)
    function.variant = name  # type: ignore[attr-defined]
    if routes_partial:
        return Variant(name, "torchgraft::rope", function, note=PARTIAL_NOTE)
    if accepts_partial:
        return Variant(name, "torchgraft::rope", function, fallback=True, note=FULL_ONLY_NOTE)
    return Variant(name, "torchgraft::rope", function)


def _no_partial_route(partial: str) -> str:
    return f"partial rotary ({partial}): no verified torchgraft route for it; the model's own"


def partial_rotary(model: nn.Module) -> str:
    """The model's partial-rotary setting (e.g. ``"partial_rotary_factor=0.25"``), or ``""``
    when its rotary embedding spans the whole head (transformers' config names, 4.x and 5.x)."""
    config = getattr(model, "config", None)
    rope_parameters = getattr(config, "rope_parameters", None)
    found: list[tuple[str, object]] = []
    if isinstance(rope_parameters, dict):
        found.append(("partial_rotary_factor", rope_parameters.get("partial_rotary_factor")))
    found += [(n, getattr(config, n, None)) for n in ("partial_rotary_factor", "rotary_pct")]
    for name, value in found:
        if isinstance(value, float | int) and not isinstance(value, bool) and value < 1:
            return f"{name}={value}"
    return ""


def _plain_signature(fn: object) -> bool:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = list(inspect.signature(target).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    names = tuple(p.name for p in params)
    return names == PARAMETERS and params[-1].default == 1


def _tables(
    positions: torch.Tensor, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin tables (``cat(freqs, freqs)``) of width ``dim``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


HEAD_DIM = 8
PARTIAL_DIM = 4
"""The probe's head size, and its rotary width for partial-rotary cases."""


def _accepts_partial(own: Callable[..., object]) -> bool:
    """Whether ``own`` takes tables narrower than the head (partial rotary) without raising;
    what it computes there is then verified by the probe."""
    q = torch.ones(1, 1, 2, HEAD_DIM)
    cos, sin = _tables(torch.arange(2.0)[None], PARTIAL_DIM, torch.float32)
    try:
        with torch.no_grad():
            out = own(q, q, cos, sin, unsqueeze_dim=1)
    except Exception:
        return False
    return isinstance(out, tuple | list) and all(
        isinstance(t, torch.Tensor) and t.shape == q.shape for t in out
    )


def _cases(partial: bool) -> list[Case]:
    """Heads-first (unsqueeze_dim=1) and sequence-first (2) layouts, grouped-query (fewer key
    heads), float32 and bfloat16, and bfloat16 q/k with float32 tables (which tells a function
    that returns the promoted dtype from one that casts back); with ``partial``, each also with
    tables half the head's width."""
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    batch, seq, heads, kv_heads, dim = 2, 5, 4, 2, HEAD_DIM
    cases = []
    for dtype, table_dtype in (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ):
        positions = torch.randint(0, 64, (batch, seq), generator=gen).float()
        for width in (dim, PARTIAL_DIM) if partial else (dim,):
            cos, sin = _tables(positions, width, table_dtype)
            for unsqueeze_dim in (1, 2):
                if unsqueeze_dim == 1:
                    q_shape, k_shape = (batch, heads, seq, dim), (batch, kv_heads, seq, dim)
                else:
                    q_shape, k_shape = (batch, seq, heads, dim), (batch, seq, kv_heads, dim)
                q = random_tensor(q_shape, gen, dtype, cpu).requires_grad_(True)
                k = random_tensor(k_shape, gen, dtype, cpu).requires_grad_(True)
                names = [str(d).removeprefix("torch.") for d in (dtype, table_dtype)]
                label = f"{names[0]} (tables {names[1]}), unsqueeze_dim={unsqueeze_dim}"
                if width != dim:
                    label += f", rotary width {width} of {dim}"
                cases.append(
                    Case(label, (q, k, cos, sin), {"unsqueeze_dim": unsqueeze_dim}, leaves=(q, k))
                )
    return cases
