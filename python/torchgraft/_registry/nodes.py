"""The records the registry keeps: one per registered override, one guard per (op, key)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def always_true(*args: Any, **kwargs: Any) -> bool:
    """The cond of an override that takes every call (``cond=None``)."""
    return True


@dataclass(eq=False)
class OverrideNode:
    """One registered override, as the registry and user ordering functions see it.

    The field names follow torch 2.13's ``torch._native.registry._OverrideNode`` so an ordering
    function written for torch works here unchanged. Nodes compare by identity.
    """

    dsl_name: str
    op_symbol: str
    dispatch_key: str
    cond_fn: Callable[..., bool]
    impl_fn: Callable[..., Any]
    #: Stable, unique id; names the opaque ``torchgraft_overrides::<node_id>`` op (compile path).
    node_id: str
    unconditional_override: bool = False
    #: The impl takes the DispatchKeySet first (the older, torch 2.12 / seed form).
    with_keyset: bool = False
    #: Enabled by the filters and kept by the ordering function (part of its router's chain).
    active: bool = True
    #: Key of this override in ``override_stats()``.
    stats_key: str = ""
    #: Times the impl was entered.
    calls: int = 0
    #: Calls this override passed on: its cond said no, or its impl re-entered the op.
    fallbacks: int = 0


class RouteGuard(threading.local):
    """Per-thread marker of what is running at one (op, dispatch key).

    ``node`` is None outside the router, COND_PHASE while conds run, and the override node while
    its impl runs. Any call of the same op meanwhile (directly, or from nested ops) goes straight
    to the kernel below the router, which is how an impl reaches "the previous kernel".
    """

    node: OverrideNode | object | None = None


#: Marker for "a cond of this (op, key) is running".
COND_PHASE = object()
