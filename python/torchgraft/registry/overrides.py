"""Registering and switching overrides: the registry's state and every change to it.

One router per (op, dispatch key) (:mod:`.dispatch_slot`) carries the enabled overrides of that
(op, key) in order; each change here (register, deregister / reenable filters, reordering,
suspending, the kill switch) brings the dispatcher in line with it (:func:`_sync`). Reading the
state is :mod:`.queries`'. The public functions are re-exported by :mod:`torchgraft.registry`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.library

from . import dispatch_slot, env
from .dispatch_slot import Slot
from .info import OverrideInfo, snapshot
from .nodes import OverrideNode, RouteGuard, always_true

__all__ = [
    "ALLOWED_LIB_SYMBOLS",
    "UserOrderingFn",
    "apply_kill_switch",
    "clear_overrides",
    "deregister_op_overrides",
    "normalize_op_symbol",
    "reenable_op_overrides",
    "register_op_override",
    "remove_override",
    "reorder_overrides",
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


def normalize_op_symbol(op_symbol: str, lib_symbol: str = "aten") -> str:
    """An op symbol as the registry keeps it: ``"aten::mm.default"`` and ``"mm"`` are ``"mm"``;
    other overloads keep their name (``"add.Tensor"``)."""
    return _normalize_op_symbol(op_symbol, lib_symbol)


def _resolve_overload(lib_symbol: str, op_symbol: str) -> torch._ops.OpOverload | None:
    """The op ``lib_symbol::op_symbol``, or None when this torch does not have it."""
    name, _, overload_name = op_symbol.partition(".")
    try:
        packet = getattr(getattr(torch.ops, lib_symbol), name)
        return getattr(packet, overload_name or "default")
    except (AttributeError, RuntimeError):
        return None


def _validate_lib_symbol(lib_symbol: str) -> str:
    # Read from the package (torchgraft.registry.ALLOWED_LIB_SYMBOLS), where callers and tests
    # set it, as when the registry was one module.
    allowed = getattr(sys.modules[__package__], "ALLOWED_LIB_SYMBOLS", ALLOWED_LIB_SYMBOLS)
    if lib_symbol not in allowed:
        # "Unsupported lib_symbol" / "is not overridable": the wordings torch._native uses.
        raise ValueError(
            f"Unsupported lib_symbol={lib_symbol!r}: it is not overridable; expected one of "
            f"{sorted(allowed)}"
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
            return dispatch_slot.restack(slot, recapture, reinstall=reinstall)

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
    dispatch_slot.teardown(slot)
    slot.chain = chain
    if want_installed:
        dispatch_slot.install(slot, _recapture_for(slot))


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
                return snapshot(slot, node)  # type: ignore[arg-type]  # a node implies a slot
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
        return snapshot(slot, node)


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
                dispatch_slot.teardown(slot)
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
            dispatch_slot.teardown(slot)
        _slots.clear()
        _compile_routers.clear()
        _filters.dsl_names.clear()
        _filters.op_symbols.clear()
        _filters.dispatch_keys.clear()
        _order_fn = None
