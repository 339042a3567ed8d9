"""The records the registry keeps: one per registered override, one guard per (op, key)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def always_true(*args: Any, **kwargs: Any) -> bool:
    """The cond of an override that takes every call (``cond=None``)."""
    return True


@dataclass(eq=False)
class OverrideNode:
    """One registered override, as the registry and user ordering functions see it.

    The fields and their order follow ``torch._native.registry._OverrideNode`` (torch 2.15) so an
    ordering function written for torch works here unchanged. Nodes compare by identity.
    """

    dsl_name: str
    #: Namespace of the op: ``"aten"`` (or ``"torch_nn"``).
    lib_symbol: str
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
    #: Strict mode: calls whose result was compared with the kernel below, and the largest
    #: absolute difference seen (inf where NaNs or None disagree).
    shadow_checks: int = 0
    max_error: float = 0.0
    #: Input signatures whose results already matched the op's meta (see ``outputs.py``).
    checked: dict[tuple[Any, ...], None] = field(default_factory=dict, repr=False)


class RouteGuard(threading.local):
    """Per-thread marker of what is running at one (op, dispatch key).

    ``node`` is None outside the router, COND_PHASE while conds run, and the override node while
    its impl runs. Any call of the same op meanwhile (directly, or from nested ops) goes straight
    to the kernel below the router, which is how an impl reaches "the previous kernel".
    """

    node: OverrideNode | object | None = None


#: Marker for "a cond of this (op, key) is running".
COND_PHASE = object()
