"""Rotary position embeddings: transformers' module-global ``apply_rotary_pos_emb`` (hub tag
``rotary_pos_emb``), routed to ``torchgraft.functional.rope``.

transformers' attention layers call the function by its global name in their modeling module, so
the replacement is installed there, for the whole process, while at least one adopted model holds
it (see :mod:`torchgraft.adopt.slots`). It takes the fused op only where the call is the plain
case (``cos``/``sin`` as wide as the head); partial rotary calls run the model's own function.
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


def _replacement(
    own: Callable[..., object], rope: Callable[..., object], cast: bool
) -> Callable[..., object]:
    """``rope`` where the call is the plain case; ``cast``: return q's and k's own dtypes (as
    OLMo2's function does) instead of the promoted one (Llama's)."""

    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> object:
        if cos.shape[-1] != q.shape[-1] or cos.shape[-1] != k.shape[-1]:
            return own(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        q_embed, k_embed = rope(q, k, cos, sin, unsqueeze_dim)
        if cast:
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed

    apply_rotary_pos_emb.__qualname__ = f"rope[{getattr(own, '__module__', '')}].{FUNCTION}"
    return apply_rotary_pos_emb


class RopeAdopter:
    """``apply_rotary_pos_emb`` in the modeling modules of a model's layers."""

    kind = "rope"
    finds = "module-global apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        seen: set[str] = set()
        for module in model.modules():
            name = type(module).__module__
            pymod = sys.modules.get(name)
            if name in seen or pymod is None or not callable(getattr(pymod, FUNCTION, None)):
                continue
            seen.add(name)
            yield self._candidate(pymod, ctx)

    def _candidate(self, pymod: types.ModuleType, ctx: Context) -> Candidate:
        own = getattr(pymod, FUNCTION)
        base = Candidate(
            self.kind, f"{pymod.__name__}.{FUNCTION}", FUNCTION, pymod, FUNCTION, "global"
        )
        held = slots.held_global(pymod, FUNCTION)
        if held is not None and own is held:
            # Another adopted model installed (and verified) it: hold it too.
            base.variants = (Variant("rotate_half", "torchgraft::rope", held),)
            return base
        if not _plain_signature(own):
            base.status, base.reason = SKIPPED, f"signature is not ({', '.join(PARAMETERS)}=1)"
            return base
        rope, missing = ctx.functional_op("rope")
        if rope is None:
            base.status, base.reason = SKIPPED, missing
            return base
        base.own = own
        base.variants = (
            Variant("rotate_half", "torchgraft::rope", _replacement(own, rope, cast=False)),
            Variant(
                "rotate_half, in q's and k's dtypes",
                "torchgraft::rope",
                _replacement(own, rope, cast=True),
            ),
        )
        base.cases = _cases
        base.run = lambda fn, case: fn(*case.args, **case.kwargs)
        return base


def _plain_signature(fn: object) -> bool:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = list(inspect.signature(target).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    names = tuple(p.name for p in params)
    return names == PARAMETERS and params[-1].default == 1


def _cases() -> list[Case]:
    """Heads-first (unsqueeze_dim=1) and sequence-first (2) layouts, grouped-query (fewer key
    heads), float32 and bfloat16, and bfloat16 q/k with float32 tables (which tells a function
    that returns the promoted dtype from one that casts back)."""
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    batch, seq, heads, kv_heads, dim = 2, 5, 4, 2, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    cases = []
    for dtype, table_dtype in (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ):
        positions = torch.randint(0, 64, (batch, seq), generator=gen).float()
        freqs = positions[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(table_dtype), emb.sin().to(table_dtype)
        for unsqueeze_dim in (1, 2):
            if unsqueeze_dim == 1:
                q_shape, k_shape = (batch, heads, seq, dim), (batch, kv_heads, seq, dim)
            else:
                q_shape, k_shape = (batch, seq, heads, dim), (batch, seq, kv_heads, dim)
            q = random_tensor(q_shape, gen, dtype, cpu).requires_grad_(True)
            k = random_tensor(k_shape, gen, dtype, cpu).requires_grad_(True)
            names = [str(d).removeprefix("torch.") for d in (dtype, table_dtype)]
            label = f"{names[0]} (tables {names[1]}), unsqueeze_dim={unsqueeze_dim}"
            cases.append(
                Case(label, (q, k, cos, sin), {"unsqueeze_dim": unsqueeze_dim}, leaves=(q, k))
            )
    return cases
