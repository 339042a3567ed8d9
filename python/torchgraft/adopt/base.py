"""The shapes every adopter shares: a candidate layer, the replacements it may take, and the
context of one :func:`torchgraft.adopt` call."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from torch import nn

from torchgraft.adopt import slots
from torchgraft.adopt.guard import Check
from torchgraft.adopt.probe import Case, Runner
from torchgraft.adopt.report import KILLED, SKIPPED

FUNCTIONAL = "torchgraft.functional"
"""Where torchgraft's fused ops (SwiGLU, GeGLU, RoPE, cross-entropy...) live when built."""


@dataclass(frozen=True)
class Variant:
    """One way to compute a layer with operators torchgraft grafts."""

    name: str
    """What numerics it reproduces, e.g. ``"llama-style"``."""
    op: str
    """The operator it routes to, e.g. ``"aten::_fused_rms_norm"``."""
    function: Callable[..., object]
    """The replacement: a ``forward(self, ...)`` for module slots, a plain function otherwise.
    It reads the module's attributes at call time, so ``.to()``, ``load_state_dict`` and
    parameter swaps keep working."""
    fallback: bool = False
    """Tried only when no other variant of the candidate agrees (e.g. a slower route kept for
    the inputs a fused op does not serve the model's way)."""
    note: str = ""
    """Shown with the adopted row (e.g. which calls keep the model's own code)."""


@dataclass
class Candidate:
    """A layer an adopter recognised, with what it needs to verify and install a replacement."""

    kind: str
    path: str
    layer: str
    owner: object
    """The object whose slot gets the replacement (an ``nn.Module``, or a Python module)."""
    slot: str
    """``"forward"``, ``"_loss_function"`` or a module-global function's name."""
    slot_kind: str
    """``"forward"`` (bound method), ``"attribute"`` (plain function) or ``"global"``."""
    own: Callable[..., object] | None = None
    """The computation now in place (what the replacement must agree with)."""
    variants: Sequence[Variant] = ()
    """Replacements to try, in order of preference."""
    cases: Callable[[], list[Case]] | None = None
    """Builds the probe cases (called only when there is something to verify)."""
    run: Runner | None = None
    hub_name: str | None = None
    """The kernel-hub layer name of the module's class (``use_kernel_forward_from_hub``), if any."""
    status: str = ""
    """Preset outcome: ``native`` (nothing to do) or ``skipped`` (cannot be adopted)."""
    reason: str = ""
    route: str = ""
    preference_key: object = None
    """Candidates with the same key (same class) try first the variant the previous one took."""
    check: Check | None = None
    """What the installed layer re-checks on each call beyond its class and the switch (see
    :mod:`torchgraft.adopt.guard`), against ``verified``."""
    verified: object = None


@dataclass
class Context:
    """State of one :func:`torchgraft.adopt` call."""

    via: str
    """``"auto"``, ``"forward"`` or ``"kernels"``."""
    use_kernels: bool
    fuse_weight: bool = False
    """RMSNorm: apply the weight inside the fused kernel (see :mod:`torchgraft.adopt.rms_norm`)."""
    killed: bool = False
    """The kill switch is set: nothing is probed, looked up or installed."""
    claimed: set[int] = field(default_factory=set)
    """ids of modules some candidate accounts for."""
    preferred: dict[object, str] = field(default_factory=dict)
    _ops: dict[str, tuple[Callable[..., object] | None, str]] = field(default_factory=dict)

    def functional_op(self, name: str) -> tuple[Callable[..., object] | None, str]:
        """``torchgraft.functional.<name>`` if this build has it, else ``None`` and the reason
        (looked up once per call to adopt, never cached across calls)."""
        if self.killed:
            return None, KILLED
        if name not in self._ops:
            self._ops[name] = _lookup(name)
        return self._ops[name]


def _lookup(name: str) -> tuple[Callable[..., object] | None, str]:
    missing = f"op not available in this build: {FUNCTIONAL}.{name}"
    try:
        # adopt -> functional, never back. Imported here, on the first lookup, not with
        # torchgraft: importing functional defines the torchgraft:: ops (it needs the compiled
        # extension), and importing torchgraft changes nothing.
        import torchgraft.functional  # noqa: F401  (read from sys.modules below)
    except ModuleNotFoundError as e:
        if e.name is not None and FUNCTIONAL.startswith(e.name):
            return None, missing
        return None, f"{missing} ({FUNCTIONAL} failed to import: {e})"
    except Exception as e:
        return None, f"{missing} ({FUNCTIONAL} failed to import: {type(e).__name__}: {e})"
    # The module as imported (sys.modules), which a test or a build may have replaced; the
    # package attribute keeps the first one.
    module = sys.modules[FUNCTIONAL]
    op = getattr(module, name, None)
    return (op, "") if callable(op) else (None, missing)


class Adopter(Protocol):
    """One row of the adoption table: a kind of layer, how to find it, what replaces it."""

    kind: str
    """Short name shown in reports, e.g. ``"rms_norm"``."""
    finds: str
    """How it finds its layers (for docs and ``repr``)."""

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        """Every layer of ``model`` this adopter recognises."""
        ...


def hub_name(module: object) -> str | None:
    """The kernel-hub layer name that transformers' ``use_kernel_forward_from_hub`` (the
    ``kernels`` package) put on the module's class, if any."""
    name = getattr(type(module), "kernel_layer_name", None)
    return name if isinstance(name, str) else None


def single_input(forward: Callable[..., object]) -> bool:
    """Whether ``forward`` (bound) takes exactly one positional argument and nothing else: a
    replacement taking one input must not meet a call passing more."""
    import inspect

    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 1 and params[0].kind in positional


def global_candidate(
    kind: str,
    pymod: types.ModuleType,
    name: str,
    variant: Callable[[Callable[..., object]], Variant],
    plain: Callable[[Callable[..., object]], str],
) -> Candidate:
    """The candidate for replacing the module-global function ``pymod.name`` process-wide.

    ``variant(own)`` builds the replacement of ``own``; ``plain(own)`` says why ``own`` cannot
    be replaced (empty if it can). Where another adopted model holds the replacement, this one
    holds it too (nothing to verify); a function someone else put there is left in place."""
    own = getattr(pymod, name)
    c = Candidate(kind, f"{pymod.__name__}.{name}", name, pymod, name, "global")
    held = slots.held_global(pymod, name)
    if held is not None and own is held[1]:
        # Another adopted model installed (and verified) it: hold it too.
        c.variants = (replace(variant(held[0]), function=own),)
        return c
    if held is not None and own is not held[0]:
        c.status = SKIPPED
        c.reason = f"{pymod.__name__}.{name} was replaced by someone else: left in place"
        return c
    if held is not None:
        own = held[0]  # the original, put back meanwhile: verify and hold again
    why = plain(own)
    if why:
        c.status, c.reason = SKIPPED, why
        return c
    c.own = own
    c.variants = (variant(own),)
    return c
