"""The compile / export path: opaque custom ops that carry an override into traced graphs.

Eager calls reach overrides through the routers in the dispatcher, but tracing (torch.compile's
AOTAutograd, ``ExportedProgram.run_decompositions``) runs below those kernels on fake tensors.
For those, each override gets an opaque op ``torchgraft_overrides::<node_id>`` with the aten op's
schema, a fake kernel that is the aten op itself (on fake tensors: its meta) and, at the
override's dispatch key, a kernel that runs the impl. A decomposition for the aten op (the
"compile router") picks the override the eager router would pick and emits its opaque op.

The namespace is not ``torchgraft`` so that the native library may own that one with a DEF.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from . import env
from .nodes import OverrideNode, RouteGuard, always_true
from .outputs import ResultCheck, returns_of
from .router import dispatch_log

NAMESPACE = "torchgraft_overrides"

_def_lib: torch.library.Library | None = None
_opaque_ops: dict[str, torch._ops.OpOverload] = {}

#: Device type -> backend dispatch key of a tensor on it.
_DEVICE_KEYS = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "xpu": "XPU",
    "mps": "MPS",
    "meta": "Meta",
    "hpu": "HPU",
    "mtia": "MTIA",
    "privateuseone": "PrivateUse1",
}


def _schema_tail(overload: torch._ops.OpOverload) -> str:
    """The schema without its name: ``aten::mm(Tensor self, ...) -> Tensor`` -> ``(...)...``."""
    text = str(overload._schema)
    return text[text.index("(") :]


def opaque_op(
    node: OverrideNode, overload: torch._ops.OpOverload, guard: RouteGuard
) -> torch._ops.OpOverload:
    """The opaque op carrying ``node`` (defined on first use, then cached for the process)."""
    op = _opaque_ops.get(node.node_id)
    if op is not None:
        return op
    global _def_lib
    if _def_lib is None:
        _def_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib = _def_lib
    lib.define(node.node_id + _schema_tail(overload))

    def fake(*args: Any, **kwargs: Any) -> Any:
        return overload(*args, **kwargs)

    # The same checks as the eager router's (no shadow run: a graph has no kernel below).
    check = ResultCheck(node, overload, returns_of(overload), strict=env.strict_mode(), below=None)

    def kernel(keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        # Same re-entrancy rule as the eager router: the impl calling the aten op reaches the
        # kernel below the router, not the override again.
        previous = guard.node
        guard.node = node
        node.calls += 1
        if dispatch_log.isEnabledFor(logging.DEBUG):
            dispatch_log.debug(
                "%s: override %s ran (compiled graph)", overload.name(), node.stats_key
            )
        try:
            if node.with_keyset:
                result = node.impl_fn(keyset, *args, **kwargs)
            else:
                result = node.impl_fn(*args, **kwargs)
            check(result, keyset, args, kwargs)
            return result
        finally:
            guard.node = previous

    torch.library.register_fake(f"{NAMESPACE}::{node.node_id}", fake, lib=lib)
    lib.impl(node.node_id, kernel, node.dispatch_key, with_keyset=True)
    op = getattr(getattr(torch.ops, NAMESPACE), node.node_id).default
    _opaque_ops[node.node_id] = op
    return op


def dispatch_key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Backend key of the first tensor argument (looking one level into lists)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            device_type = value.device.type
            return _DEVICE_KEYS.get(device_type, device_type.upper())
    return None


ChainLookup = Callable[[str], "tuple[tuple[OverrideNode, ...], RouteGuard] | None"]


def make_compile_router(overload: torch._ops.OpOverload, lookup: ChainLookup) -> Callable[..., Any]:
    """Decomposition for ``overload``: the matching override's opaque op, else NotImplemented.

    ``lookup(dispatch_key)`` returns the live chain, so a table built earlier follows later
    deregistrations. Cond exceptions count as no match: conds meet fake tensors here, on which
    some predicates (e.g. ``torch._C._is_cow_tensor``) are undefined.
    """

    def compile_router(*args: Any, **kwargs: Any) -> Any:
        key = dispatch_key_of(args, kwargs)
        found = lookup(key) if key is not None else None
        if found is None:
            return NotImplemented
        chain, guard = found
        for node in chain:
            if node.cond_fn is not always_true:
                try:
                    matched = node.cond_fn(*args, **kwargs)
                except Exception:
                    continue
                if not matched:
                    continue
            return opaque_op(node, overload, guard)(*args, **kwargs)
        return NotImplemented

    return compile_router
