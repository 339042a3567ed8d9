"""The graft registry: torch._native's override API on torch 2.11 to 2.15.

A kernel written in any DSL takes over an op at one backend dispatch key, for every call or
for the calls its ``cond`` accepts; every other call falls through to the kernel that was there
before. One router per (op, dispatch key) is installed through ``torch.library``:

* each call tries the conds in order (registration order, or what the ordering function makes
  of it); the first match runs its impl, whose result is checked against the op's schema and
  meta (``_registry/outputs.py``);
* no match calls the previous kernel, captured with ``torch.library.get_kernel`` when the router
  was installed and called with ``call_boxed`` (captured again whenever what is below changes,
  ``_registry/slots.py``);
* inside an impl (or cond), calling the same op again, directly or from nested ops, reaches the
  previous kernel instead of the router (a per-thread guard), which is how an impl falls back.

Overrides are live as soon as they are registered. ``TORCHGRAFT_DISABLE=1`` (the kill switch) is
read at every change to the registry: while it is set, registering is a no-op and no router stays
in the dispatcher (see :func:`apply_kill_switch`). Nothing here imports a DSL. See
docs/registry.md for the composition order and the environment.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.library

from ._registry import env, slots
from ._registry.compile import make_compile_router, opaque_op
from ._registry.nodes import OverrideNode, RouteGuard, always_true
from ._registry.outputs import OverrideResultError
from ._registry.slots import Slot

__all__ = [
    "ALLOWED_LIB_SYMBOLS",
    "FilterState",
    "OverrideInfo",
    "OverrideNode",
    "OverrideResultError",
    "UserOrderingFn",
    "apply_kill_switch",
    "clear_overrides",
    "deregister_op_overrides",
    "filter_state",
    "get_dsl_operations",
    "list_overrides",
    "native_decomp_table",
    "normalize_op_symbol",
    "override_stats",
    "reenable_op_overrides",
    "register_op_override",
    "remove_override",
    "reorder_overrides",
    "reset_stats",
    "suspend_routers",
]

log = logging.getLogger("torchgraft.registry")

#: ``fn(op_symbol, dispatch_key, nodes) -> nodes``: reorders, or drops, the enabled overrides of
#: one (op, key). Same shape as torch's ``torch._native.registry.UserOrderingFn``.
UserOrderingFn = Callable[[str, str, list[OverrideNode]], list[OverrideNode]]

#: Namespaces whose ops can be overridden: aten, and torch_nn (torch 2.15's Python-defined ops
#: such as ``torch_nn::_linear_cross_entropy_batch_chunked``), as in torch._native.
ALLOWED_LIB_SYMBOLS = frozenset({"aten", "torch_nn"})

#: Keys where a router cannot live: the opaque op's fake kernel calls the aten op, and alias keys
#: are not places a kernel can be fetched from or fall back to.
_REFUSED_KEYS = frozenset(
    {
        "Meta",
        "CompositeImplicitAutograd",
        "CompositeExplicitAutograd",
        "CompositeExplicitAutogradNonFunctional",
    }
)


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


@dataclass
class _Filters:
    """Sticky deregistration filters (torch._native semantics): a node matching any set is off."""

    dsl_names: set[str] = field(default_factory=set)
    op_symbols: set[str] = field(default_factory=set)
    dispatch_keys: set[str] = field(default_factory=set)

    def enabled(self, node: OverrideNode) -> bool:
        return not (
            node.dsl_name in self.dsl_names
            or node.op_symbol in self.op_symbols
            or node.dispatch_key in self.dispatch_keys
        )


_SlotKey = tuple[str, str, str]

_lock = threading.RLock()
_slots: dict[_SlotKey, Slot] = {}
# Guards outlive slots: opaque-op kernels compiled into graphs keep using theirs.
_guards: dict[_SlotKey, RouteGuard] = {}
_filters = _Filters()
_order_fn: UserOrderingFn | None = None
_suspend_depth = 0
# TORCHGRAFT_DISABLE as last read by apply_kill_switch(): while True no router is installed.
_killed = False
_node_ids = itertools.count()
_compile_routers: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


# ----------------------------------------------------------------------------- validation


def _normalize_op_symbol(op_symbol: str, lib_symbol: str = "aten") -> str:
    """``"aten::mm.default"`` / ``"mm.default"`` / ``"mm"`` -> ``"mm"``; keeps other overloads."""
    if not isinstance(op_symbol, str) or not op_symbol.strip():
        raise TypeError(f"op_symbol must be a non-empty string, got {op_symbol!r}")
    symbol = op_symbol.strip()
    prefix = f"{lib_symbol}::"
    if symbol.startswith(prefix):
        symbol = symbol[len(prefix) :]
    if symbol.endswith(".default"):
        symbol = symbol[: -len(".default")]
    return symbol


def _resolve_overload(lib_symbol: str, op_symbol: str) -> torch._ops.OpOverload | None:
    """The op ``lib_symbol::op_symbol``, or None when this torch does not have it."""
    name, _, overload_name = op_symbol.partition(".")
    try:
        packet = getattr(getattr(torch.ops, lib_symbol), name)
        return getattr(packet, overload_name or "default")
    except (AttributeError, RuntimeError):
        return None


def _validate_lib_symbol(lib_symbol: str) -> str:
    if lib_symbol not in ALLOWED_LIB_SYMBOLS:
        # "Unsupported lib_symbol" / "is not overridable": the wordings torch._native uses.
        raise ValueError(
            f"Unsupported lib_symbol={lib_symbol!r}: it is not overridable; expected one of "
            f"{sorted(ALLOWED_LIB_SYMBOLS)}"
        )
    return lib_symbol


def _validate_dispatch_key(dispatch_key: str) -> str:
    if not isinstance(dispatch_key, str):
        raise TypeError(f"dispatch_key must be a string like 'CPU' or 'CUDA', got {dispatch_key!r}")
    member = torch._C.DispatchKey.__members__.get(dispatch_key)
    if member is None:
        raise ValueError(f"unknown dispatch key {dispatch_key!r} (expected e.g. 'CPU' or 'CUDA')")
    if dispatch_key in _REFUSED_KEYS or torch._C._dispatch_is_alias_key(member):
        raise ValueError(
            f"dispatch_key={dispatch_key!r} is not supported: overrides are installed at a "
            "backend key (e.g. CPU, CUDA, XPU), below autograd, so aten's derivative formulas "
            "stay in charge and the compile path's fake kernel (the aten op's meta) cannot "
            "recurse into the router."
        )
    return dispatch_key


def _names(value: str | Iterable[str] | None, normalize: Callable[[str], str] = str) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, str):
        return {normalize(value)}
    return {normalize(v) for v in value}


def _describe(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _node_id(op_symbol: str, dsl: str) -> str:
    # A valid, never reused op name: the opaque op's definition lives as long as the process.
    raw = f"{op_symbol}_{dsl}_{next(_node_ids)}"
    return re.sub(r"\W", "_", raw)


def _stats_key(dsl: str, qualname: str, dispatch_key: str) -> str:
    base = f"{dsl}/{qualname}/{dispatch_key}"
    taken = {n.stats_key for slot in _slots.values() for n in slot.nodes}
    if base not in taken:
        return base
    for i in itertools.count(2):
        if f"{base}#{i}" not in taken:
            return f"{base}#{i}"
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- installing


def _current_order_fn() -> UserOrderingFn | None:
    return _order_fn if _order_fn is not None else env.env_order_fn()


def _ordered(slot: Slot, enabled: list[OverrideNode]) -> list[OverrideNode]:
    """Apply the ordering function; on any misbehaviour keep registration order (and say why)."""
    if not enabled:
        return enabled
    try:
        fn = _current_order_fn()
    except ValueError:
        log.exception("ignoring the override ordering function")
        return enabled
    if fn is None:
        return enabled
    try:
        result = fn(slot.op_symbol, slot.dispatch_key, list(enabled))
    except Exception:
        # "Graph transformation failed": torch._native's wording for the same event.
        log.warning(
            "Graph transformation failed for %s at %s: the override ordering function raised; "
            "keeping registration order",
            slot.qualname,
            slot.dispatch_key,
            exc_info=True,
        )
        return enabled
    allowed = {id(n) for n in enabled}
    if not isinstance(result, list) or any(id(n) not in allowed for n in result):
        log.warning(
            "override ordering function returned %r for %s at %s, not a list of the nodes it was "
            "given; keeping registration order",
            type(result).__name__,
            slot.qualname,
            slot.dispatch_key,
        )
        return enabled
    if len({id(n) for n in result}) != len(result):
        log.warning(
            "override ordering function repeated a node for %s at %s; keeping registration order",
            slot.qualname,
            slot.dispatch_key,
        )
        return enabled
    return result


def _recapture_for(slot: Slot) -> Callable[[], Callable[..., Any]]:
    """What a router calls when its captured kernel is invalidated: re-stack, return the new one."""

    def recapture() -> Callable[..., Any]:
        with _lock:
            reinstall = bool(slot.chain) and _routers_wanted() and _slots.get(slot.key) is slot
            return slots.restack(slot, recapture, reinstall=reinstall)

    return recapture


def _routers_wanted() -> bool:
    """Whether active overrides' routers belong in the dispatcher now."""
    return _suspend_depth == 0 and not _killed


def apply_kill_switch() -> bool:
    """Read ``TORCHGRAFT_DISABLE`` and bring the dispatcher in line; return whether it is set.

    While it is set no router of this registry stays installed (the overrides stay registered,
    as with :func:`suspend_routers`); once it is unset, the next call puts them back. Every
    change to the registry calls this first, and so do :func:`torchgraft.enable` and the other
    switches: the variable is read when something is switched, never on an op call.
    """
    global _killed
    with _lock:
        killed = env.kill_switch_set()
        if killed != _killed:
            _killed = killed
            log.info(
                "%s is %s: %s every router",
                env.DISABLE_ENV,
                "set" if killed else "unset",
                "removing" if killed else "reinstalling",
            )
            for slot in list(_slots.values()):
                _sync(slot)
        return killed


def _sync(slot: Slot, *, force: bool = False) -> None:
    """Bring the dispatcher in line with the slot's nodes, filters and ordering."""
    if slot.overload is None:
        # Ops defined by Python modules (torch_nn's) appear once their module is imported.
        slot.overload = _resolve_overload(slot.lib_symbol, slot.op_symbol)
    if slot.overload is None:
        # This torch lacks the op: keep the overrides registered, never active.
        for node in slot.nodes:
            node.active = False
        return
    enabled = [n for n in slot.nodes if _filters.enabled(n)]
    chain = tuple(_ordered(slot, enabled))
    kept = {id(n) for n in chain}
    for node in slot.nodes:
        node.active = id(node) in kept
    want_installed = bool(chain) and _routers_wanted()
    if not force and chain == slot.chain and (slot.lib is not None) == want_installed:
        return
    slots.teardown(slot)
    slot.chain = chain
    if want_installed:
        slots.install(slot, _recapture_for(slot))


# ----------------------------------------------------------------------------- public API


def register_op_override(
    dsl: str,
    lib_symbol: str,
    op_symbol: str,
    dispatch_key: str,
    cond: Callable[..., bool] | None,
    impl: Callable[..., Any],
    *,
    unconditional_override: bool = False,
    allow_multiple_override: bool = False,
    with_keyset: bool = False,
) -> OverrideInfo | None:
    """Override ``lib_symbol::op_symbol`` at ``dispatch_key`` with ``impl`` where ``cond`` holds.

    Args:
        dsl: Name of the DSL the impl is written in ("triton", "cutedsl", ...); used by filters.
        lib_symbol: The op's namespace: ``"aten"`` (or ``"torch_nn"``, see
            :data:`ALLOWED_LIB_SYMBOLS`).
        op_symbol: ``"bmm"`` (default overload) or ``"add_.Tensor"``.
        dispatch_key: A backend key such as ``"CPU"`` or ``"CUDA"``. Meta, alias keys
            (CompositeImplicitAutograd, CompositeExplicitAutograd, ...) are refused.
        cond: ``cond(*args, **kwargs) -> bool`` with the op's arguments; None only together with
            ``unconditional_override=True`` (or ``with_keyset=True``): take every call.
        impl: ``impl(*args, **kwargs)`` returning what the op returns (for in-place and out=
            ops: the mutated argument itself). Calling the same op inside it reaches the kernel
            that was there before the router. Its results are checked against the op's schema
            and meta (:class:`OverrideResultError` when they differ).
        unconditional_override: The override takes every call when ``cond`` is None.
        allow_multiple_override: Accepted for torch._native compatibility; several overrides of
            one DSL at one (op, key) are always allowed (tried in registration order).
            Registering the very same (cond, impl) again is a no-op.
        with_keyset: ``impl`` receives the ``torch.DispatchKeySet`` first (the older form of the
            seeds and torch 2.12); with ``cond=None`` it then takes every call and decides itself.

    Returns:
        A snapshot of the registered override, or None when the kill switch
        (``TORCHGRAFT_DISABLE=1``) made registration a no-op. An override of an op this torch
        does not have is kept, inactive, with a warning (code written for a newer torch still
        imports on an older one).

    Raises:
        ValueError: bad lib_symbol or dispatch key, ``cond=None`` without an unconditional
            form, or a ``TORCHGRAFT_OVERRIDE_ORDER_FN`` that cannot be imported.
        TypeError: cond or impl is not callable.
    """
    if not isinstance(dsl, str) or not dsl.strip():
        raise ValueError(f"dsl must be a non-empty string, got {dsl!r}")
    lib = _validate_lib_symbol(lib_symbol)
    symbol = _normalize_op_symbol(op_symbol, lib)
    key = _validate_dispatch_key(dispatch_key)
    if not callable(impl):
        raise TypeError(f"impl must be callable, got {type(impl).__name__}")
    if cond is None:
        if not (unconditional_override or with_keyset):
            raise ValueError(
                "cond must be provided unless unconditional_override=True "
                f"(registering {dsl} for {lib}::{symbol} at {key})"
            )
        cond = always_true
    elif not callable(cond):
        raise TypeError(f"cond must be callable or None, got {type(cond).__name__}")

    if apply_kill_switch():
        log.info(
            "%s=1: not registering the %s override of %s::%s at %s",
            env.DISABLE_ENV,
            dsl,
            lib,
            symbol,
            key,
        )
        return None
    _current_order_fn()  # a bad TORCHGRAFT_OVERRIDE_ORDER_FN is reported here, to the caller

    with _lock:
        slot = _slots.get((lib, symbol, key))
        for node in slot.nodes if slot is not None else ():
            if (
                node.dsl_name == dsl
                and node.impl_fn is impl
                and node.cond_fn is cond
                and node.with_keyset == with_keyset
            ):
                log.debug("%s is already registered; nothing to do", node.stats_key)
                return _info(slot, node)  # type: ignore[arg-type]  # a node implies a slot
        if slot is None:
            overload = _resolve_overload(lib, symbol)
            if overload is None:
                warnings.warn(
                    f"torchgraft: {lib}::{symbol} does not exist in torch {torch.__version__}; "
                    f"the {dsl} override at {key} is kept but stays inactive",
                    UserWarning,
                    stacklevel=2,
                )
            guard = _guards.setdefault((lib, symbol, key), RouteGuard())
            slot = Slot(lib, symbol, key, overload, guard)
            _slots[slot.key] = slot
        node = OverrideNode(
            dsl_name=dsl,
            lib_symbol=lib,
            op_symbol=symbol,
            dispatch_key=key,
            cond_fn=cond,
            impl_fn=impl,
            node_id=_node_id(symbol, dsl),
            unconditional_override=unconditional_override,
            with_keyset=with_keyset,
            stats_key=_stats_key(dsl, slot.qualname, key),
        )
        slot.nodes.append(node)
        try:
            _sync(slot)
        except Exception:
            slot.nodes.remove(node)
            _sync(slot, force=True)
            raise
        log.debug("registered %s (active=%s)", node.stats_key, node.active)
        return _info(slot, node)


def deregister_op_overrides(
    *,
    disable_dsl_names: str | Iterable[str] | None = None,
    disable_op_symbols: str | Iterable[str] | None = None,
    disable_dispatch_keys: str | Iterable[str] | None = None,
) -> None:
    """Switch off every override whose DSL, op or dispatch key is named (torch 2.13 semantics).

    The filters are sticky: they also apply to overrides registered later, until
    :func:`reenable_op_overrides` lifts them. A (op, key) left with no active override gets
    its previous kernel back exactly. Calling with no filter changes nothing.
    """
    log.info(
        "deregistering overrides: dsl=%s op=%s key=%s",
        disable_dsl_names,
        disable_op_symbols,
        disable_dispatch_keys,
    )
    with _lock:
        apply_kill_switch()
        _filters.dsl_names |= _names(disable_dsl_names)
        _filters.op_symbols |= _names(disable_op_symbols, _normalize_op_symbol)
        _filters.dispatch_keys |= _names(disable_dispatch_keys)
        for slot in list(_slots.values()):
            _sync(slot)


def reenable_op_overrides(
    *,
    enable_dsl_names: str | Iterable[str] | None = None,
    enable_op_symbols: str | Iterable[str] | None = None,
    enable_dispatch_keys: str | Iterable[str] | None = None,
) -> None:
    """Lift filters set by :func:`deregister_op_overrides` and reinstall what they had disabled."""
    log.info(
        "re-enabling overrides: dsl=%s op=%s key=%s",
        enable_dsl_names,
        enable_op_symbols,
        enable_dispatch_keys,
    )
    with _lock:
        apply_kill_switch()
        _filters.dsl_names -= _names(enable_dsl_names)
        _filters.op_symbols -= _names(enable_op_symbols, _normalize_op_symbol)
        _filters.dispatch_keys -= _names(enable_dispatch_keys)
        for slot in list(_slots.values()):
            _sync(slot)


def reorder_overrides(fn: UserOrderingFn | None) -> None:
    """Set the ordering function for every (op, key), now and for later registrations.

    ``fn(op_symbol, dispatch_key, nodes)`` gets the enabled overrides of one (op, key) in
    registration order and returns the ones to install, in the order to try them; leaving a node
    out drops it (it stays registered, inactive). ``None`` goes back to
    ``TORCHGRAFT_OVERRIDE_ORDER_FN`` if set, else registration order. If ``fn`` raises or
    returns something else than a list of the nodes it was given, registration order is kept and
    a warning is logged.
    """
    global _order_fn
    if fn is not None and not callable(fn):
        raise TypeError(f"ordering function must be callable, got {type(fn).__name__}")
    with _lock:
        apply_kill_switch()
        _order_fn = fn
        for slot in list(_slots.values()):
            _sync(slot)


def _info(slot: Slot, node: OverrideNode) -> OverrideInfo:
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


def list_overrides() -> list[OverrideInfo]:
    """Every registered override (active or not), by (op, key) then registration order."""
    with _lock:
        return [_info(slot, node) for slot in _slots.values() for node in slot.nodes]


def _node_stats(node: OverrideNode) -> dict[str, float]:
    stats: dict[str, float] = {"calls": node.calls, "fallbacks": node.fallbacks}
    if node.shadow_checks:
        stats["shadow_checks"] = node.shadow_checks
        stats["max_error"] = node.max_error
    return stats


def filter_state() -> FilterState:
    """The DSL names, op symbols and dispatch keys :func:`deregister_op_overrides` has switched
    off (and :func:`reenable_op_overrides` not yet back on)."""
    with _lock:
        return FilterState(
            frozenset(_filters.dsl_names),
            frozenset(_filters.op_symbols),
            frozenset(_filters.dispatch_keys),
        )


def normalize_op_symbol(op_symbol: str, lib_symbol: str = "aten") -> str:
    """An op symbol as the registry keeps it: ``"aten::mm.default"`` and ``"mm"`` are ``"mm"``;
    other overloads keep their name (``"add.Tensor"``)."""
    return _normalize_op_symbol(op_symbol, lib_symbol)


def get_dsl_operations(dsl_name: str, lib_symbol: str = "aten") -> list[str]:
    """The op symbols ``dsl_name`` has overrides for in namespace ``lib_symbol``, sorted.

    torch._native's function of the same name and meaning (one namespace per call: op symbols
    are unique within a namespace, not across them).
    """
    with _lock:
        return sorted(
            {
                slot.op_symbol
                for slot in _slots.values()
                if slot.lib_symbol == lib_symbol and any(n.dsl_name == dsl_name for n in slot.nodes)
            }
        )


def override_stats() -> dict[str, dict[str, float]]:
    """``{"<dsl>/<op>/<key>": {"calls": n, "fallbacks": m}}`` for every registered override.

    ``calls`` counts the times the impl was entered (eager router and compiled graphs alike).
    ``fallbacks`` counts the calls this override passed on to what is below it: its cond
    returned False (the call went on to the next override or the previous kernel), or its impl
    called the op again and so reached the previous kernel (the seed's ``_smart_rms_norm`` gate
    for small shapes). Counts are plain integers; under heavy multithreading they may miss a few.

    In strict mode (``TORCHGRAFT_STRICT=1``) an override whose results were compared with the
    kernel below also has ``shadow_checks`` (how many) and ``max_error`` (the largest absolute
    elementwise difference seen; ``inf`` where NaNs, None or shapes disagreed).
    """
    with _lock:
        return {
            node.stats_key: _node_stats(node) for slot in _slots.values() for node in slot.nodes
        }


def reset_stats() -> None:
    """Set every override's counters (and strict-mode errors) back to zero."""
    with _lock:
        for slot in _slots.values():
            for node in slot.nodes:
                node.calls = 0
                node.fallbacks = 0
                node.shadow_checks = 0
                node.max_error = 0.0


@contextlib.contextmanager
def suspend_routers() -> Iterator[None]:
    """Take every router out of the dispatcher for the duration of the block.

    On entry each installed router is torn down, restoring the kernel below it; on exit the
    active routers are installed again on top of whatever is there then, capturing their
    fallbacks afresh. Wrap anything that installs or removes kernels under the routers in it
    (torchgraft's native kernels, torch._native's own control functions), so fallbacks never
    point at a kernel that is gone. Registrations inside the block take effect on exit. Nests.
    """
    global _suspend_depth
    with _lock:
        _suspend_depth += 1
        if _suspend_depth == 1:
            for slot in _slots.values():
                slots.teardown(slot)
    try:
        yield
    finally:
        with _lock:
            _suspend_depth -= 1
            if _suspend_depth == 0:
                apply_kill_switch()
                for slot in list(_slots.values()):
                    _sync(slot, force=True)


def remove_override(info: OverrideInfo) -> bool:
    """Remove one registered override (the one ``register_op_override`` returned ``info`` for).

    Unlike :func:`deregister_op_overrides`, which switches off every override a filter names
    (and keeps doing so for later registrations), this removes exactly this override and
    leaves no filter behind. The (op, key) gets its previous kernel back when no override is
    left. Returns whether the override was registered.
    """
    with _lock:
        slot = _slots.get((info.lib_symbol, info.op_symbol, info.dispatch_key))
        node = next((n for n in slot.nodes if n.node_id == info.node_id), None) if slot else None
        if slot is None or node is None:
            return False
        slot.nodes.remove(node)
        _sync(slot, force=True)
        if not slot.nodes:
            del _slots[slot.key]
        log.debug("removed %s", node.stats_key)
        return True


def clear_overrides() -> None:
    """Remove every override, filter and ordering function, restoring the dispatcher exactly.

    Opaque ops defined for compiled graphs stay defined (ops cannot be undefined safely while
    graphs may reference them); their ids are never reused.
    """
    global _order_fn
    with _lock:
        for slot in _slots.values():
            slots.teardown(slot)
        _slots.clear()
        _compile_routers.clear()
        _filters.dsl_names.clear()
        _filters.op_symbols.clear()
        _filters.dispatch_keys.clear()
        _order_fn = None


def _compile_lookup(lib_symbol: str, op_symbol: str) -> Callable[[str], Any]:
    def lookup(dispatch_key: str) -> tuple[tuple[OverrideNode, ...], RouteGuard] | None:
        slot = _slots.get((lib_symbol, op_symbol, dispatch_key))
        if slot is None or not slot.chain:
            return None
        return slot.chain, slot.guard

    return lookup


def native_decomp_table(overrides_only: bool = False) -> dict[Any, Callable[..., Any]]:
    """Decompositions that carry the active overrides into compiled and exported graphs.

    Each overridden aten overload maps to a "compile router" that, while tracing, picks the
    override the eager router would pick for the arguments' device and emits its opaque op
    ``torchgraft_overrides::<node_id>`` (which runs the impl when the graph runs); with no match
    it returns NotImplemented so the op is traced as usual. Use it with
    ``ExportedProgram.run_decompositions(native_decomp_table())`` or as the ``decompositions`` of
    a torch.compile backend (e.g. ``aot_autograd(..., decompositions=native_decomp_table())``).

    Args:
        overrides_only: Only the override entries; otherwise they are layered over
            ``torch.export.default_decompositions()`` and win on conflicts.
    """
    table: dict[Any, Callable[..., Any]] = {}
    if not overrides_only:
        from torch.export import default_decompositions

        table.update(default_decompositions())
    with _lock:
        for slot in _slots.values():
            overload = slot.overload
            if not slot.chain or overload is None:
                continue
            for node in slot.chain:
                opaque_op(node, overload, slot.guard)  # define outside of any tracing
            router = _compile_routers.get(overload)
            if router is None:
                lookup = _compile_lookup(slot.lib_symbol, slot.op_symbol)
                router = make_compile_router(overload, lookup)
                _compile_routers[overload] = router
            table[overload] = router
    return table
