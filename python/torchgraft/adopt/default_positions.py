"""Positions a model makes itself are never packed: transformers' packed-sequence check, skipped
for the calls where the base model derives its own positions.

Called without ``position_ids``, ``attention_mask`` and a cache (a training step), a transformers
base model makes its positions ``0, 1, ..., L-1`` for every row, then asks
``masking_utils.find_packed_sequence_indices`` whether they hold several packed sequences. Eager,
that check reads a device tensor on the host (one synchronization per forward); while tracing it
cannot read it at all, so a compiled model always treats its positions as packed: it builds a
``(batch, 1, L, L)`` mask and SDPA takes its masked kernels (on the H100 the 1b Llama's attention
ran 2.8x slower compiled than eager).

Two replacements answer the check without reading data. The base model's ``forward`` records,
for the duration of the call, whether its caller left the positions to the model (no
``position_ids``, ``attention_mask``, ``past_key_values`` or ``cache_position``); transformers'
``find_packed_sequence_indices`` (process-wide) then says "not packed" for those calls and asks
the model's own function for every other. The probe checks the claim each model class rests on:
called without them, the base model hands the check consecutive positions in every row (so its
own eager answer is "not packed" too), and its outputs are the model's own.

The record is per thread, and set and restored around each adopted base model's call (a nested
base model records its own caller's choice).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, global_candidate
from torchgraft.adopt.probe import Case, training_mode
from torchgraft.adopt.report import SKIPPED

MODULE = "transformers.masking_utils"
FUNCTION = "find_packed_sequence_indices"
MASK_BUILDER = "create_causal_mask"
"""What a base model's Python module imports from ``MODULE`` when its forward builds the mask."""
OP = "aten::scaled_dot_product_attention"
DERIVED_WITHOUT = ("attention_mask", "position_ids", "past_key_values", "cache_position")
"""The arguments left out (or ``None``) in a call whose positions the model derives."""


class _Record(threading.local):
    def __init__(self) -> None:
        self.derived = False


_POSITIONS = _Record()


def _check_replacement(own: Callable[..., object]) -> Callable[..., object]:
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if _POSITIONS.derived:
            return None
        return own(position_ids)  # type: ignore[return-value]

    find_packed_sequence_indices.__qualname__ = f"default_positions[{MODULE}].{FUNCTION}"
    return find_packed_sequence_indices


def _check_variant(own: Callable[..., object]) -> Variant:
    return Variant("derived positions are not packed", OP, _check_replacement(own))


def _one_tensor_parameter(own: Callable[..., object]) -> str:
    try:
        names = tuple(inspect.signature(own).parameters)
    except (TypeError, ValueError):
        names = ()
    return "" if names == ("position_ids",) else "signature is not (position_ids)"


def _forward_replacement(indices: tuple[tuple[str, int | None], ...]) -> Callable[..., object]:
    """The base model's forward: its own, with the record of whether the positions are derived
    (``indices``: where each of :data:`DERIVED_WITHOUT` sits among its positional parameters)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> object:
        derived = all(
            kwargs.get(name) is None and (i is None or i >= len(args) or args[i] is None)
            for name, i in indices
        )
        outer = _POSITIONS.derived
        _POSITIONS.derived = derived
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            _POSITIONS.derived = outer

    forward.__qualname__ = "default_positions[base model].forward"
    return forward


@functools.cache
def _forward_variant(cls: type) -> Variant | None:
    """One variant per base-model class (``None`` where its forward lacks the arguments)."""
    try:
        params = list(inspect.signature(cls.forward).parameters)[1:]  # without self
    except (TypeError, ValueError):
        return None
    if "position_ids" not in params or "attention_mask" not in params:
        return None
    indices = tuple((n, params.index(n) if n in params else None) for n in DERIVED_WITHOUT)
    return Variant("derived positions are not packed", OP, _forward_replacement(indices))


class DefaultPositionsAdopter:
    """transformers' packed-sequence check, answered without data where the base model derives
    its own positions (models whose attention implementation is ``sdpa``)."""

    kind = "default_positions"
    finds = f"{MODULE}.{FUNCTION} and each base model whose forward calls {MASK_BUILDER}"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        masking = sys.modules.get(MODULE)
        config = getattr(model, "config", None)
        if masking is None or getattr(config, "_attn_implementation", None) != "sdpa":
            return
        if not callable(getattr(masking, FUNCTION, None)):
            return
        check = global_candidate(
            self.kind, masking, FUNCTION, _check_variant, _one_tensor_parameter
        )
        check.cases = _check_cases if check.own is not None else None
        check.run = _run_check
        yield check
        seen: set[int] = set()
        for path, module in model.named_modules():
            base = getattr(module, "base_model", None)
            if isinstance(base, nn.Module) and id(base) not in seen:
                seen.add(id(base))
                yield self._base_candidate(_path_of(model, base, path), base, masking)

    def _base_candidate(self, path: str, base: nn.Module, masking: types.ModuleType) -> Candidate:
        cls = type(base)
        c = Candidate(self.kind, path, cls.__name__, base, "forward", "forward")
        # The forward's own module (FSDP2's and peft's wrapper classes live elsewhere).
        home = getattr(cls.forward, "__module__", None)
        builder = getattr(sys.modules.get(home or ""), MASK_BUILDER, None)
        variant = _forward_variant(cls)
        if builder is not getattr(masking, MASK_BUILDER, None) or variant is None:
            c.status, c.reason = SKIPPED, "its forward does not build transformers' causal mask"
            return c
        if "forward" in base.__dict__:
            c.status, c.reason = SKIPPED, "a forward is set on the instance"
            return c
        c.own = base.forward
        c.variants = (variant,)
        c.cases = functools.partial(_base_cases, base)
        c.run = functools.partial(_run_base, base, masking)
        c.preference_key = (self.kind, cls)
        return c


def _path_of(model: nn.Module, module: nn.Module, fallback: str) -> str:
    for path, m in model.named_modules():
        if m is module:
            return path
    return fallback


# Positions as the check meets them: (positions, derived by the model). Consecutive from 0 (what a
# model derives, expanded over the batch as transformers expands it), consecutive from an offset,
# and packed rows, which only a caller passes.
def _check_cases() -> list[Case]:
    consecutive = torch.arange(7).unsqueeze(0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    rows = (
        ("derived", consecutive.expand(2, -1), True),
        ("derived, one row", consecutive, True),
        ("passed, consecutive from 3", consecutive + 3, False),
        ("passed, packed", packed, False),
    )
    return [Case(label, (positions, derived)) for label, positions, derived in rows]


def _run_check(fn: Callable[..., object], case: Case) -> object:
    """The check's answer with the base model's record as it would be; a call whose positions
    the model derives must also be "not packed" by transformers' own eager check (else the
    claim this rests on is false for that transformers)."""
    positions, derived = case.args
    assert isinstance(positions, torch.Tensor) and isinstance(derived, bool)
    own = getattr(sys.modules[MODULE], FUNCTION)
    if derived and _answer(getattr(own, "own", own), positions) is not None:
        raise ValueError("transformers' own check finds consecutive positions packed")
    return _answer(fn, positions, derived)


def _answer(fn: Callable[..., object], positions: torch.Tensor, derived: bool = False) -> object:
    outer = _POSITIONS.derived
    _POSITIONS.derived = derived
    try:
        return fn(positions)
    finally:
        _POSITIONS.derived = outer


def _base_cases(base: nn.Module) -> list[Case]:
    """A short random batch without positions, mask or cache (in eval mode: dropout would draw
    differently on the two sides)."""
    vocab = getattr(getattr(base, "config", None), "vocab_size", None)
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    if not isinstance(vocab, int) or vocab < 1:
        return []
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=gen).to(device)
    return [Case("derived positions", (), {"input_ids": ids, "use_cache": False}, training=False)]


def _run_base(
    base: nn.Module, masking: types.ModuleType, fn: Callable[..., object], case: Case
) -> object:
    """The base model's last hidden state, with every position it hands the packed-sequence
    check verified consecutive (what its own eager check answers "not packed" for)."""
    seen: list[torch.Tensor] = []
    check = getattr(masking, FUNCTION)

    def recording(position_ids: torch.Tensor) -> object:
        seen.append(position_ids)
        return check(position_ids)

    setattr(masking, FUNCTION, recording)
    try:
        with training_mode(base, case.training), torch.no_grad():
            out = fn(*case.args, **case.kwargs)
    finally:
        setattr(masking, FUNCTION, check)
    if not seen:
        raise ValueError("it does not ask transformers' packed-sequence check")
    for positions in seen:
        if positions.numel() and not bool((positions.diff(dim=-1) == 1).all()):
            raise ValueError("the positions it derives are not consecutive")
    hidden = getattr(out, "last_hidden_state", None)
    return hidden if isinstance(hidden, torch.Tensor) else out
