"""Routes a benchmark compares, and the dispatcher state each one runs under.

A route is one way to compute an op: a stock composite, ATen's fused kernel, torch.compile,
each torchgraft route, a third-party kernel. Each says whether it can run on a device (and why
not), builds its callable for one problem, and names the dispatcher state it needs: torchgraft
off or on with one route, and torch._native's own override of the op off or on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import torchgraft
from torchgraft import control, native, registry
from torchgraft.registry import torch_native

__all__ = [
    "Route",
    "RouteUnavailable",
    "always_available",
    "module_available",
    "stock_dispatch",
    "torch_native_active",
    "torch_native_dispatch",
    "torchgraft_dispatch",
    "torchgraft_route_unavailable",
]


class RouteUnavailable(Exception):
    """A route cannot run here; the message says why."""


@dataclass(frozen=True)
class Route:
    """One way to compute an op, as the benchmark runs it."""

    name: str
    """Name in tables, JSON and ``--routes``, e.g. ``"aten"``, ``"torchgraft-native"``."""
    summary: str
    """One line on what runs."""
    unavailable: Callable[[torch.device], str | None]
    """Why the route cannot run on a device, or None when it can."""
    build: Callable[[Any], Callable[..., Any]]
    """Builds the route's function for one problem (the op's own signature)."""
    dispatch: Callable[[], contextlib.AbstractContextManager[object]]
    """The dispatcher state the route runs under (entered around its verification and timing)."""
    graft_prefix: str | None = None
    """Prefix of the graft counters that show this route ran (``"native/"``), if it has any."""


def always_available(_device: torch.device) -> str | None:
    """A route's ``unavailable`` for routes that run on every device: no reason."""
    return None


def module_available(name: str) -> bool:
    """Whether top-level module ``name`` is installed, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _dsl_module(name: str) -> Any | None:
    """``torchgraft.dsl.<name>`` when the registry's DSL helpers exist (imports no DSL)."""
    if importlib.util.find_spec("torchgraft.dsl") is None:
        return None
    import torchgraft.dsl as dsl

    return getattr(dsl, "DSLS", {}).get(name)


def torchgraft_route_unavailable(route: str, device: torch.device | None) -> str | None:
    """Why torchgraft route ``route`` (``"native"``, ``"triton"``, ...) cannot graft anything on
    ``device`` (any device when None), or None when it can."""
    if route not in control.ROUTES:
        return f"this torchgraft has no route {route!r} (it has {', '.join(control.ROUTES)})"
    if _env_flag(control.DISABLE_ENV):
        return f"{control.DISABLE_ENV} is set"
    if route == "native":
        if _env_flag(control.DISABLE_NATIVE_ENV):
            return f"{control.DISABLE_NATIVE_ENV} is set"
        if not native.available():
            return "the extension torchgraft._native is not built"
        if device is not None:
            key = device.type.upper()
            if not any(g.dispatch_key == key for g in native.grafts()):
                return f"this build of torchgraft._native has no graft for {key}"
        return None
    # Every other route is a DSL that runs on CUDA GPUs; a missing DSL is the first thing to say.
    reason = dsl_unusable_reason(route)
    if reason is None and device is not None and device.type != "cuda":
        reason = f"the {route} route runs on CUDA devices only"
    return reason


def dsl_unusable_reason(name: str) -> str | None:
    """Why DSL ``name``'s overrides would not be registered, or None (never imports the DSL)."""
    module = _dsl_module(name)
    if module is not None:
        runtime = getattr(module, "runtime", None)
        unusable = getattr(runtime, "unusable_reason", None)
        if unusable is not None:
            return unusable()
        if not module.runtime_available():
            return f"{name} is not installed"
        return None
    if name == "triton" and not module_available("triton"):
        return "triton is not installed (module 'triton' not found)"
    return None


# torch 2.13+ ships its own override of some ops (a CuteDSL RMSNorm when nvidia-cutlass-dsl is
# installed). It is kept out of every route but its own, so "aten" means ATen's kernel. All of
# torch._native is read through torchgraft's version-gated view of it.


def torch_native_active(op_symbol: str, dispatch_key: str) -> bool:
    """Whether torch._native (torch 2.12+) has an active override of ``aten::op_symbol``."""
    return torch_native.active(op_symbol, dispatch_key)


@contextlib.contextmanager
def _torch_native_off(op_symbols: tuple[str, ...]) -> Iterator[None]:
    active = [op for op in op_symbols if torch_native.active(op, "CUDA")]
    if not active:
        yield
        return
    # torchgraft's routers come out while torch._native's change under them.
    with registry.suspend_routers():
        torch_native.deregister_op_overrides(active)
    try:
        yield
    finally:
        with registry.suspend_routers():
            torch_native.reenable_op_overrides(active)


@contextlib.contextmanager
def stock_dispatch(op_symbols: tuple[str, ...]) -> Iterator[None]:
    """PyTorch as shipped: torchgraft off, torch._native's overrides of these ops off."""
    torchgraft.disable()
    with _torch_native_off(op_symbols):
        yield


@contextlib.contextmanager
def torch_native_dispatch() -> Iterator[None]:
    """torchgraft off, torch._native as shipped."""
    torchgraft.disable()
    yield


@contextlib.contextmanager
def torchgraft_dispatch(route: str, op_symbols: tuple[str, ...]) -> Iterator[None]:
    """torchgraft with only ``route`` enabled, torch._native's overrides of these ops off."""
    torchgraft.disable()
    with _torch_native_off(op_symbols), torchgraft.enabled(routes=[route]):
        yield
