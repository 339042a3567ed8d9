"""The dispatcher side of one (op, dispatch key): installing its router and taking it out.

A router captures the kernel below it when it is installed, and calls it for every call no
override takes. Kernels at one (op, key) stack, so whenever the registration below a router
changes, the router must be installed again to capture the new one (torch 2.15 invalidates the
old capture: "SafeKernelFunction has been invalidated"). The same holds the other way round:
torch._native's router, when it sits above ours, captured ours, so taking ours out or putting a
new one in must make torch._native rebuild its router too. This module does both:

* :func:`install` puts the router on top and notes which torch._native router (if any) was
  below it then;
* :func:`teardown` takes it out and, if torch._native rebuilt its router since (so it sits
  above ours and captured ours), has torch._native rebuild it again on what is below;
* :func:`restack` does both in one go; the router calls it (through the registry) when it finds
  its captured kernel invalidated, then calls the fresh capture.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.library

from . import env, torch_native
from .nodes import OverrideNode, RouteGuard
from .router import MissingKernel, make_router

log = logging.getLogger("torchgraft.registry")

# The dispatcher warns (once per process) when a kernel replaces another at the same key;
# stacking kernels is what the registry is for.
OVERRIDE_WARNING = r"(?s).*(Overriding a previously registered kernel|other operators may also)"


@dataclass(eq=False)
class Slot:
    """Everything about one (op, dispatch key): its overrides and its installed router."""

    lib_symbol: str
    op_symbol: str
    dispatch_key: str
    #: The op, or None when this torch has no such op (its overrides stay inactive).
    overload: torch._ops.OpOverload | None
    guard: RouteGuard
    #: Registration order.
    nodes: list[OverrideNode] = field(default_factory=list)
    #: What the router tries, in order (filters and ordering function applied).
    chain: tuple[OverrideNode, ...] = ()
    lib: torch.library.Library | None = None
    #: torch._native's router library at this (op, key) when ours was installed (below ours).
    torch_native_below: object | None = None

    @property
    def qualname(self) -> str:
        return f"{self.lib_symbol}::{self.op_symbol}"

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.lib_symbol, self.op_symbol, self.dispatch_key)


def _capture_below(slot: Slot) -> Callable[..., Any]:
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(
        slot.qualname, slot.dispatch_key
    ):
        return MissingKernel(slot.qualname, slot.dispatch_key)
    return torch.library.get_kernel(slot.qualname, slot.dispatch_key).call_boxed


def install(slot: Slot, recapture: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """Install the router for ``slot.chain`` on top of whatever kernel is there now.

    Returns the kernel below it that the router captured.
    """
    assert slot.overload is not None and slot.lib is None
    slot.torch_native_below = torch_native.router_token(
        slot.op_symbol, slot.dispatch_key, slot.lib_symbol
    )
    below = _capture_below(slot)
    router = make_router(
        slot.chain,
        below,
        slot.guard,
        slot.overload,
        strict=env.strict_mode(),
        recapture=recapture,
    )
    lib = torch.library.Library(slot.lib_symbol, "IMPL")
    claims: set[str] | None = getattr(torch.library, "_impls", None)
    claim = f"{slot.lib_symbol}/{slot.op_symbol}/{slot.dispatch_key}"
    had_claim = claims is not None and claim in claims
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OVERRIDE_WARNING, category=UserWarning)
        lib.impl(slot.op_symbol, router, slot.dispatch_key, with_keyset=True, allow_override=True)
    # Library.impl claims (op, key) for Python libraries, which makes any later Python
    # registration there (torch._native's router, for one) fail. The dispatcher stacks kernels,
    # so give the claim back, and make sure tearing ours down never drops someone else's.
    getattr(lib, "_op_impls", set()).discard(claim)
    if claims is not None and not had_claim:
        claims.discard(claim)
    slot.lib = lib
    log.debug(
        "router installed: %s at %s -> %s",
        slot.qualname,
        slot.dispatch_key,
        [n.stats_key for n in slot.chain],
    )
    return below


def teardown(slot: Slot) -> None:
    """Take the router out, leaving torch._native's router (if any) with a valid capture."""
    if slot.lib is None:
        return
    current = torch_native.router_token(slot.op_symbol, slot.dispatch_key, slot.lib_symbol)
    slot.lib._destroy()
    slot.lib = None
    log.debug("router removed: %s at %s", slot.qualname, slot.dispatch_key)
    if current is not None and current is not slot.torch_native_below:
        # torch._native rebuilt its router after ours was installed: it sits above ours and
        # captured ours as its fallback, which is gone now. Have it capture what is below.
        torch_native.reinstall(slot.op_symbol, slot.dispatch_key, slot.lib_symbol)
    slot.torch_native_below = None


def restack(
    slot: Slot, recapture: Callable[[], Callable[..., Any]], *, reinstall: bool
) -> Callable[..., Any]:
    """Take the router out and (with ``reinstall``) put it back on top of what is there now.

    Used when the router's captured kernel turns out invalidated: something below it changed
    (typically torch._native rebuilding its router from its own control functions). Returns
    the kernel now below the router, to finish the call that found out.
    """
    log.info(
        "the kernel below torchgraft's router for %s at %s changed; installing it again",
        slot.qualname,
        slot.dispatch_key,
    )
    teardown(slot)
    if not reinstall:
        return _capture_below(slot)
    return install(slot, recapture)
