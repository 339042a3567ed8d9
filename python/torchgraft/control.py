"""Switching torchgraft on and off, and reading what ran."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torchgraft import native, registry
from torchgraft.ops import attention, rms_norm
from torchgraft.ops.linear_cross_entropy import registration as linear_cross_entropy

log = logging.getLogger("torchgraft")

_lock = threading.RLock()
_enabled = False

DISABLE_ENV = "TORCHGRAFT_DISABLE"
"""Set to 1 to make :func:`enable` a no-op (the global kill switch)."""
DISABLE_NATIVE_ENV = "TORCHGRAFT_DISABLE_NATIVE"
"""Set to 1 to keep the native route (Rust / CUDA C++ kernels) out of :func:`enable`."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


ROUTES = ("native", "triton", "cutedsl", "helion")
"""The routes :func:`enable` can install: ``"native"`` (Rust CPU and CUDA C++ kernels through the
stable C ABI), and the op library's DSL kernels through the registry, on CUDA: ``"triton"``
(RMSNorm), ``"cutedsl"`` (FlashAttention-4 under SDPA, quack's RMSNorm) and ``"helion"``
(RMSNorm)."""

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
    # quack's RMSNorm ran on par with the native kernel (182.8 vs 183.4 us at 8x4096x4096).
    ("cutedsl", rms_norm, _NAMED),
    ("helion", rms_norm, _NAMED),
)


def enable(routes: Iterable[str] | None = None) -> None:
    """Install torchgraft's grafts under PyTorch's operators.

    After this, unchanged model code (``F.rms_norm``, ``nn.RMSNorm``, ...) runs torchgraft's
    kernels wherever they apply, in forward and backward; everything else runs as before.

    Args:
        routes: which routes to install (see :data:`ROUTES`). By default the native route, the
            Triton route where the native route has no CUDA kernels (both cover the same ops
            on CUDA; the native one launches with less host overhead), and FlashAttention-4
            under SDPA where it was measured faster (when flash-attn-4 is installed). Named
            routes install all their kernels; registry overrides sit on top of the native
            kernels and fall back to them outside their conds.

    Idempotent: calling it again while enabled changes nothing (call :func:`disable` first to
    switch routes). ``TORCHGRAFT_DISABLE=1`` turns it into a no-op.
    """
    global _enabled
    wanted = set(ROUTES if routes is None else routes)
    unknown = wanted - set(ROUTES)
    if unknown:
        raise ValueError(f"unknown route(s) {sorted(unknown)}; known: {list(ROUTES)}")
    with _lock:
        if _env_flag(DISABLE_ENV):
            log.info("torchgraft.enable() skipped: %s is set", DISABLE_ENV)
            return
        if _enabled:
            return
        native_wanted = "native" in wanted and _native_allowed()
        try:
            # The Python routes first: registering them is the step that can fail on user input
            # (a bad TORCHGRAFT_OVERRIDE_ORDER_FN); the native route's enable is all or nothing.
            for route, package, default in _GRAFTS:
                if route in wanted and _installs(default, routes is not None, native_wanted):
                    package.register(route)
            if native_wanted:
                # Routers capture the kernel below them when installed: rebuild them on top.
                with registry.suspend_routers():
                    native.enable()
        except BaseException:
            _undo()
            raise
        _enabled = True


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
    """Remove whatever :func:`enable` installed (after a failed enable: whatever it got to)."""
    for _route, package, _default in _GRAFTS:
        package.deregister()
    with registry.suspend_routers():
        native.disable()


def disable() -> None:
    """Remove every graft :func:`enable` installed, restoring PyTorch's own kernels. Idempotent."""
    global _enabled
    with _lock:
        _undo()
        _enabled = False


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
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
        was_enabled = _enabled
        enable(routes)
    try:
        yield
    finally:
        if not was_enabled:
            disable()


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
