"""Switching torchgraft on and off, and reading what ran.

One rule for every route (the native grafts, the registry's overrides, adopted layers): while
``TORCHGRAFT_DISABLE=1`` is set, or a :func:`disabled` block is open, nothing of torchgraft runs.
:func:`enable` installs the grafts, :func:`disable` removes them; adopted layers follow both
(:func:`adopted_layers_active`). The per-DSL and per-op switches (:mod:`torchgraft.backends`)
keep their state here too, so every route reads one place. State changes take ``_lock``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torchgraft import native, registry
from torchgraft.grafts import attention, grouped_mm, rms_norm
from torchgraft.ops.linear_cross_entropy import registration as linear_cross_entropy

log = logging.getLogger("torchgraft.control")

_lock = threading.RLock()
_enabled = False
"""torchgraft's grafts are installed now (what adopted layers read on every call)."""
_request: frozenset[str] | None = None
"""The routes the last :func:`enable` asked for (``ROUTES`` when it named none): restored when a
:func:`disabled` block ends; None after :func:`disable`."""
_named = False
"""That :func:`enable` named its routes (see :func:`_installs`)."""
_native_installed = False
"""The native route is part of what is installed (its kernels: see :func:`_sync_native`)."""
_native_off = False
"""``torchgraft.backends.native.enabled = False``: the native grafts stay out."""
_off_blocks = 0
"""Open :func:`disabled` blocks, in any thread."""

DISABLE_ENV = "TORCHGRAFT_DISABLE"


def gate_notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> why that route's override takes the calls it takes``, for every
    registry graft (``torchgraft list`` shows it). Imports no DSL."""
    from torchgraft.grafts.attention.registration import notes as attention_notes
    from torchgraft.grafts.grouped_mm.registration import notes as grouped_mm_notes
    from torchgraft.grafts.rms_norm.registration import notes as rms_norm_notes

    return attention_notes() | grouped_mm_notes() | linear_cross_entropy.notes() | rms_norm_notes()


"""Set to 1 and nothing of torchgraft runs (the global kill switch): :func:`enable` and
registering overrides are no-ops, and adopted layers run the model's own code. Read whenever
something is switched: set after :func:`enable`, it takes everything out at the next switch."""
DISABLE_NATIVE_ENV = "TORCHGRAFT_DISABLE_NATIVE"
"""Set to 1 to keep the native route (Rust / CUDA C++ kernels) out of :func:`enable`."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


ROUTES = ("native", "triton", "cutedsl", "helion", "cutile")
"""The routes :func:`enable` can install: ``"native"`` (Rust CPU and CUDA C++ kernels through the
stable C ABI), and the op library's DSL kernels through the registry, on CUDA: ``"triton"``
(RMSNorm), ``"cutedsl"`` (FlashAttention-4 under SDPA, quack's grouped GEMM under
``torch._grouped_mm``, quack's RMSNorm), ``"helion"`` (RMSNorm) and ``"cutile"`` (RMSNorm)."""

# When enable() without routes installs each (route, op package): always (where a GPU is), only
# where the native route has no CUDA kernels (the same op, with less host overhead), or only when
# named. A "native" package (registry overrides whose impls run native ops) goes with the native
# route where a GPU is, named or not: on a CPU-only machine its routers would cost a Python
# kernel registration per enable() (torch.library retains memory for each) for CPU training.
_ALWAYS, _NO_NATIVE_CUDA, _NAMED = "always", "no native CUDA kernels", "when named"
_NATIVE_ON_GPU = "with the native route where a GPU is"
_GRAFTS: tuple[tuple[str, Any, str], ...] = (
    # torch 2.14+'s F.linear_cross_entropy(options=...) op, served by the native fused kernel.
    ("native", linear_cross_entropy, _NATIVE_ON_GPU),
    ("triton", rms_norm, _NO_NATIVE_CUDA),
    # FA4 has no native sibling; its conds take only problems where it was measured faster.
    ("cutedsl", attention, _ALWAYS),
    # quack's varlen GEMMs: 1.06-1.22x ATen's grouped GEMM at the MoE experts' shapes (H200).
    ("cutedsl", grouped_mm, _ALWAYS),
    # quack's RMSNorm ran on par with the native kernel (182.8 vs 183.4 us at 8x4096x4096).
    ("cutedsl", rms_norm, _NAMED),
    ("helion", rms_norm, _NAMED),
    # Not yet run on a GPU (docs/dsl.md, cuTile).
    ("cutile", rms_norm, _NAMED),
)


def enable(routes: Iterable[str] | None = None) -> None:
    """Install torchgraft's grafts under PyTorch's operators.

    After this, unchanged model code (``F.rms_norm``, ``nn.RMSNorm``, ...) runs torchgraft's
    kernels wherever they apply, in forward and backward, and layers :func:`torchgraft.adopt`
    routed run torchgraft's path; everything else runs as before.

    Args:
        routes: which routes to install (see :data:`ROUTES`). By default the native route, the
            Triton route where the native route has no CUDA kernels (both cover the same ops
            on CUDA; the native one launches with less host overhead), FlashAttention-4 under
            SDPA where it was measured faster (when flash-attn-4 is installed), and quack's
            grouped GEMM under ``torch._grouped_mm`` for MoE experts on Hopper (when
            quack-kernels is installed). Named routes install all their kernels; registry
            overrides sit on top of the native kernels and fall back to them outside their
            conds.

    Idempotent: calling it again while enabled changes nothing (call :func:`disable` first to
    switch routes). Ops and DSLs switched off in :mod:`torchgraft.backends` stay off. Inside a
    :func:`disabled` block it takes effect when the block ends. With ``TORCHGRAFT_DISABLE=1`` it
    installs nothing, and removes whatever an earlier call installed.
    """
    global _request, _named
    wanted = frozenset(ROUTES if routes is None else routes)
    unknown = wanted - set(ROUTES)
    if unknown:
        raise ValueError(f"unknown route(s) {sorted(unknown)}; known: {list(ROUTES)}")
    with _lock:
        if _kill_switch_set():
            log.info("torchgraft.enable() skipped: %s is set", DISABLE_ENV)
            return
        if _enabled:
            return
        if _off_blocks:
            log.info("torchgraft.enable() inside torchgraft.disabled(): takes effect at its end")
            _request, _named = wanted, routes is not None
            return
        _install(wanted, routes is not None)
        _request, _named = wanted, routes is not None


def _install(wanted: frozenset[str], named: bool) -> None:
    """Install ``wanted``'s grafts, all or nothing; sets ``_enabled``."""
    global _enabled, _native_installed
    native_wanted = "native" in wanted and _native_allowed()
    try:
        # The Python routes first: registering them is the step that can fail on user input
        # (a bad TORCHGRAFT_OVERRIDE_ORDER_FN); the native route's enable is all or nothing.
        for route, package, default in _GRAFTS:
            if route in wanted and _installs(default, named, native_wanted):
                package.register(route)
        _native_installed = native_wanted
        _sync_native()
    except BaseException:
        _undo()
        raise
    _enabled = True
    log.info("torchgraft enabled: routes %s", sorted(wanted))


def _sync_native() -> None:
    """Bring the native kernels in line with the switches: registered, less the ops switched
    off, while the native route is installed and ``backends.native`` is on; out otherwise."""
    # Routers capture the kernel below them when installed: rebuild them on top.
    with registry.suspend_routers():
        if _native_installed and not _native_off:
            native.enable(sorted(_disabled_ops))
        else:
            native.disable()


def _native_allowed() -> bool:
    if _env_flag(DISABLE_NATIVE_ENV):
        log.info("native route skipped: %s is set", DISABLE_NATIVE_ENV)
        return False
    if not native.available():
        log.info("native route skipped: the extension torchgraft._native is not built")
        return False
    return True


def _installs(default: str, named: bool, native_wanted: bool) -> bool:
    """Whether ``enable()`` installs a Python-route package marked ``default`` (its route was
    asked for, by name when ``named``).

    The DSL ones by default only where a GPU is (their overrides sit at CUDA: on a machine without
    one their routers would never run, yet cost memory), the Triton RMSNorm only where the native
    route has no CUDA kernels; every one when named, except the "native" packages, which go with
    the native route where a GPU is.
    """
    import torch

    if default == _NATIVE_ON_GPU:
        return native_wanted and torch.cuda.is_available()
    if named:
        return True
    if default == _NAMED or not torch.cuda.is_available():
        return False
    if default == _NO_NATIVE_CUDA:
        return not (native_wanted and native.cuda_devices() > 0)
    return True


def _undo() -> None:
    """Remove whatever :func:`_install` installed (after a failed one: whatever it got to)."""
    global _enabled, _native_installed
    for _route, package, _default in _GRAFTS:
        package.deregister()
    _native_installed = False
    with registry.suspend_routers():
        native.disable()
    _enabled = False


def _kill_switch_set() -> bool:
    """Read ``TORCHGRAFT_DISABLE``; while it is set, make sure nothing of torchgraft is in the
    dispatcher (the registry's routers come out; an earlier :func:`enable` is undone)."""
    global _request
    if not registry.apply_kill_switch():
        return False
    if _enabled or _request is not None:
        log.warning("%s is set: switching torchgraft off", DISABLE_ENV)
        _undo()
        _request = None
    return True


def disable() -> None:
    """Remove every graft :func:`enable` installed, restoring PyTorch's own kernels; adopted
    layers run the model's own code again. Idempotent. Overrides you registered yourself with
    :func:`torchgraft.register_op_override` stay (switch them with :mod:`torchgraft.backends`,
    :func:`disabled` or the registry's functions). Inside a :func:`disabled` block, it also
    keeps torchgraft off when the block ends."""
    global _request
    with _lock:
        _request = None
        _undo()
        _kill_switch_set()


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect (False inside a :func:`disabled` block)."""
    return _enabled


_disabled_ops: frozenset[str] = frozenset()
"""Operator symbols switched off one by one (bare names: ``"_fused_rms_norm"``, ``"swiglu"``)."""


def adopted_layers_active(op: str) -> bool:
    """Whether a layer :func:`torchgraft.adopt` routed to operator ``op`` (a bare symbol such as
    ``"swiglu"``) runs torchgraft's path now: torchgraft is enabled and ``op`` is not switched
    off. Otherwise the layer runs the model's own code. Cheap: adopted layers ask on every
    call."""
    return _enabled and op not in _disabled_ops


@contextlib.contextmanager
def enabled(routes: Iterable[str] | None = None) -> Iterator[None]:
    """Enable torchgraft inside a ``with`` block (see :func:`enable`); restore the previous state
    on exit."""
    with _lock:
        was_requested = _request is not None
        enable(routes)
    try:
        yield
    finally:
        if not was_requested:
            disable()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Nothing of torchgraft runs inside the ``with`` block: the grafts :func:`enable` installed
    come out, the registry's overrides (your own included) stand down, adopted layers run the
    model's own code. On exit the state before the block comes back, also after an exception.

    For A/B comparisons without :func:`torchgraft.unadopt`. Blocks nest and may overlap across
    threads: torchgraft stays off until the last one ends. :func:`enable` or :func:`disable`
    called inside set the state the end of the block restores. Like :func:`enable`, the switch
    changes the dispatcher: flip it between steps, not while other threads run the model.
    """
    global _off_blocks
    with registry.suspend_routers():  # every router out, the user's overrides included
        with _lock:
            _off_blocks += 1
            if _off_blocks == 1 and _enabled:
                _undo()
                log.info("torchgraft off inside torchgraft.disabled()")
        try:
            yield
        finally:
            with _lock:
                _off_blocks -= 1
                if _off_blocks == 0 and _request is not None and not _kill_switch_set():
                    _restore()


def _restore() -> None:
    """Install what the last :func:`enable` asked for (at the end of a :func:`disabled` block)."""
    global _request
    assert _request is not None
    try:
        _install(_request, _named)
    except BaseException:
        _request = None
        raise


def set_operations_disabled(op_symbols: Iterable[str], off: bool) -> None:
    """Switch ops off (``off``) or back on, on every route: the registry's overrides of them,
    the native grafts of them, adopted layers routed to them. Symbols as the registry reads them
    (``"aten::mm"``, ``"mm.default"`` and ``"mm"`` are ``"mm"``); one overload each."""
    global _disabled_ops
    symbols = frozenset(registry.normalize_op_symbol(op) for op in op_symbols)
    if not symbols:
        return
    with _lock:
        if off:
            registry.deregister_op_overrides(disable_op_symbols=symbols)
            changed = _disabled_ops | symbols
        else:
            registry.reenable_op_overrides(enable_op_symbols=symbols)
            changed = _disabled_ops - symbols
        if changed == _disabled_ops:
            return
        _disabled_ops = frozenset(changed)
        log.info("ops switched off: %s", sorted(_disabled_ops) or "none")
        if _native_installed and not _native_off:
            _sync_native()


def is_operation_disabled(op_symbol: str) -> bool:
    """Whether ``op_symbol`` is switched off by :func:`set_operations_disabled`."""
    return registry.normalize_op_symbol(op_symbol) in _disabled_ops


def disabled_operations() -> list[str]:
    """The op symbols switched off by :func:`set_operations_disabled`, sorted."""
    return sorted(_disabled_ops)


def set_dsl_enabled(dsl: str, on: bool) -> None:
    """Switch one DSL's registry overrides on or off; for ``"native"`` also the native grafts
    (torchgraft's own operators keep their kernels: they have no others)."""
    global _native_off
    with _lock:
        if on:
            registry.reenable_op_overrides(enable_dsl_names=dsl)
        else:
            registry.deregister_op_overrides(disable_dsl_names=dsl)
        log.info("DSL %s switched %s", dsl, "on" if on else "off")
        if dsl == "native" and _native_off == on:
            _native_off = not on
            if _native_installed:
                _sync_native()


def is_dsl_enabled(dsl: str) -> bool:
    """Whether ``dsl`` is on (not switched off by :func:`set_dsl_enabled` or the registry's
    ``deregister_op_overrides(disable_dsl_names=...)``)."""
    if dsl == "native" and _native_off:
        return False
    return dsl not in registry.filter_state().dsl_names


def stats() -> dict[str, dict[str, int]]:
    """Per-graft counters: ``{"native/aten::_fused_rms_norm/CPU": {"calls": 3, "fallbacks": 0}}``.

    Native grafts: ``calls`` counts calls that reached the kernel, ``fallbacks`` those it computed
    by a slower general path. The kernels of torchgraft's own operators
    (``native/torchgraft::swiglu/CPU``) count the same way. Python-route overrides (keys
    ``"<dsl>/<op>/<key>"``): ``calls`` counts impl runs, ``fallbacks`` calls passed on to the
    kernel below (cond false, or the impl called the op again).
    """
    native_stats = {
        f"native/{g.op}/{g.dispatch_key}": {"calls": g.calls, "fallbacks": g.fallbacks}
        for g in native.grafts() + native.op_kernels()
    }
    return native_stats | registry.override_stats()


def reset_stats() -> None:
    """Zero every graft's counters."""
    native.reset_stats()
    registry.reset_stats()
