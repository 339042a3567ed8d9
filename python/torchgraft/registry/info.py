"""What the registry reports about an override: the snapshot types and how a snapshot is taken.

No registry state lives here (:mod:`.overrides` holds it), so both the registering side and the
reading side (:mod:`.queries`) build their answers from these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .dispatch_slot import Slot
from .nodes import OverrideNode, always_true

__all__ = ["FilterState", "OverrideInfo", "snapshot"]


@dataclass(frozen=True)
class OverrideInfo:
    """A snapshot of one registered override (see :func:`list_overrides`)."""

    dsl: str
    #: Qualified op, e.g. ``"aten::_fused_rms_norm"`` or ``"aten::add_.Tensor"``.
    op: str
    op_symbol: str
    dispatch_key: str
    #: Enabled by the filters and kept by the ordering function (never for a missing op).
    active: bool
    #: Its router is in the dispatcher right now (False while routers are suspended).
    installed: bool
    #: Index in its router's chain (0 is tried first), None when not active.
    position: int | None
    unconditional: bool
    #: The impl takes the DispatchKeySet first (older / seed form).
    with_keyset: bool
    #: Times the impl was entered.
    calls: int
    #: Calls passed on: the cond said no, or the impl re-entered the op (reaching the kernel below).
    fallbacks: int
    #: Key in :func:`override_stats`: ``"<dsl>/<op>/<dispatch_key>"`` (``#2``... for repeats).
    stats_key: str
    node_id: str
    impl: str
    cond: str | None
    #: Namespace of the op (``"aten"``).
    lib_symbol: str = "aten"
    #: This torch has the op; an override of an op it lacks is kept but never active.
    op_available: bool = True
    #: Strict mode: calls compared with the kernel below, and the largest difference seen.
    shadow_checks: int = 0
    max_error: float = 0.0


@dataclass(frozen=True)
class FilterState:
    """What :func:`deregister_op_overrides` has switched off, as :func:`filter_state` reads it."""

    dsl_names: frozenset[str]
    op_symbols: frozenset[str]
    dispatch_keys: frozenset[str]


def _describe(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def snapshot(slot: Slot, node: OverrideNode) -> OverrideInfo:
    """The :class:`OverrideInfo` of ``node`` as it stands now in ``slot``."""
    position = next((i for i, n in enumerate(slot.chain) if n is node), None)
    return OverrideInfo(
        dsl=node.dsl_name,
        op=slot.qualname,
        op_symbol=node.op_symbol,
        dispatch_key=node.dispatch_key,
        active=node.active,
        installed=slot.lib is not None and position is not None,
        position=position,
        unconditional=node.unconditional_override,
        with_keyset=node.with_keyset,
        calls=node.calls,
        fallbacks=node.fallbacks,
        stats_key=node.stats_key,
        node_id=node.node_id,
        impl=_describe(node.impl_fn) or "",
        cond=None if node.cond_fn is always_true else _describe(node.cond_fn),
        lib_symbol=slot.lib_symbol,
        op_available=slot.overload is not None,
        shadow_checks=node.shadow_checks,
        max_error=node.max_error,
    )
