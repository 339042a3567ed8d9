"""The eager router: one Python kernel per (op, dispatch key), installed by the registry."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .nodes import COND_PHASE, OverrideNode, RouteGuard, always_true
from .outputs import ResultCheck, returns_of

#: What torch (2.15+) raises when a captured kernel's registration has gone away.
INVALIDATED = "has been invalidated"

#: Which override (or the kernel below) took each call, at DEBUG (``TORCHGRAFT_LOGS=+dispatch``).
#: Each call asks the logger whether DEBUG is on; nothing is formatted when it is not.
dispatch_log = logging.getLogger("torchgraft.dispatch")
_DEBUG = logging.DEBUG


class MissingKernel:
    """Stand-in fallback for an (op, key) that had no kernel before the router was installed."""

    def __init__(self, qualname: str, dispatch_key: str) -> None:
        self.qualname = qualname
        self.dispatch_key = dispatch_key

    def __call__(self, keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Could not run '{self.qualname}' with arguments from the '{self.dispatch_key}' "
            f"backend: no torchgraft override at {self.dispatch_key} took this call and there "
            f"was no {self.dispatch_key} kernel before the overrides were installed to fall "
            "back to."
        )


def make_router(
    chain: tuple[OverrideNode, ...],
    fallback: Callable[..., Any],
    guard: RouteGuard,
    overload: torch._ops.OpOverload,
    *,
    strict: bool,
    recapture: Callable[[], Callable[..., Any]],
) -> Callable[..., Any]:
    """Build the kernel for one (op, key): first matching cond wins, else the kernel below.

    ``fallback`` is the captured kernel below (its ``call_boxed``). When torch reports it
    invalidated (its registration went away: something below the router changed),
    ``recapture()`` re-stacks the routers at this (op, key) and returns the fresh kernel below,
    which then takes the call. Every impl's result is checked (see ``outputs.py``): its
    structure on each call, its metadata on the first call per input signature, and with
    ``strict`` its metadata and values on every call. Cond exceptions propagate.
    """
    returns = returns_of(overload)

    def call_below(keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        # The router's own fallback, as a function (the router inlines the same steps).
        try:
            return fallback(keyset, *args, **kwargs)
        except RuntimeError as exc:
            if INVALIDATED not in str(exc):
                raise
        return recapture()(keyset, *args, **kwargs)

    shadow = None if isinstance(fallback, MissingKernel) else call_below

    def entry(node: OverrideNode) -> tuple[Any, ...]:
        check = ResultCheck(node, overload, returns, strict=strict, below=shadow)
        cond = None if node.cond_fn is always_true else node.cond_fn
        return (
            cond,
            node.impl_fn,
            node.with_keyset,
            node,
            check,
            check.plain,
            check.signature,
            node.checked,
        )

    entries = tuple(entry(node) for node in chain)
    quick = not strict and not returns.aliased
    logging_on = dispatch_log.isEnabledFor
    where = f"{overload.name()} at {chain[0].dispatch_key}" if chain else overload.name()

    def router(keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        running = guard.node
        if running is None:
            guard.node = COND_PHASE
            try:
                for cond, impl, with_keyset, node, check, plain, signature, checked in entries:
                    if cond is not None and not cond(*args, **kwargs):
                        node.fallbacks += 1
                        continue
                    node.calls += 1
                    if logging_on(_DEBUG):
                        dispatch_log.debug("%s: override %s ran", where, node.stats_key)
                    saved = check.before(args, kwargs) if strict else None
                    guard.node = node
                    if with_keyset:
                        result = impl(keyset, *args, **kwargs)
                    else:
                        result = impl(*args, **kwargs)
                    # The common case inline (this is every call's cost): a well-formed result
                    # for inputs whose signature already passed the metadata check.
                    if quick and plain(result):
                        try:
                            if signature(args, kwargs) in checked:
                                return result
                        except TypeError:  # an unhashable argument: the check below copes
                            pass
                    check(result, keyset, args, kwargs, saved)
                    return result
            finally:
                guard.node = None
            if logging_on(_DEBUG):
                dispatch_log.debug("%s: no override took the call; the kernel below ran", where)
        elif running is not COND_PHASE:
            # Re-entered from an impl of this (op, key): go to the kernel below.
            running.fallbacks += 1  # type: ignore[union-attr]
            if logging_on(_DEBUG):
                dispatch_log.debug(
                    "%s: re-entered from %s; the kernel below ran",
                    where,
                    running.stats_key,  # type: ignore[union-attr]
                )
        try:
            return fallback(keyset, *args, **kwargs)
        except RuntimeError as exc:
            if INVALIDATED not in str(exc):
                raise
        # What was below changed (torch reports the capture invalidated): capture it again.
        return recapture()(keyset, *args, **kwargs)

    return router
