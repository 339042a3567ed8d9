"""The eager router: one Python kernel per (op, dispatch key), installed by the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .nodes import COND_PHASE, OverrideNode, RouteGuard, always_true

#: (return index, argument position or keyword name) for each return that aliases a written arg.
AliasCheck = tuple[int, int | str]


def aliased_returns(schema: torch._C.FunctionSchema) -> tuple[AliasCheck, ...]:
    """Where an in-place / out= op must return its mutated argument, e.g. ``add_`` returns self."""
    checks: list[AliasCheck] = []
    for ret_index, ret in enumerate(schema.returns):
        ret_alias = ret.alias_info
        if ret_alias is None or not ret_alias.is_write:
            continue
        for arg_index, arg in enumerate(schema.arguments):
            arg_alias = arg.alias_info
            if arg_alias is not None and arg_alias.is_write:
                if arg_alias.before_set == ret_alias.before_set:
                    checks.append((ret_index, arg.name if arg.kwarg_only else arg_index))
                    break
    return tuple(checks)


def missing_kernel(qualname: str, dispatch_key: str) -> Callable[..., Any]:
    """Stand-in fallback for an (op, key) that had no kernel before the router was installed."""

    def call(keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Could not run '{qualname}' with arguments from the '{dispatch_key}' backend: "
            f"no torchgraft override at {dispatch_key} took this call and there was no "
            f"{dispatch_key} kernel before the overrides were installed to fall back to."
        )

    return call


def check_aliases(
    result: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    checks: tuple[AliasCheck, ...],
    n_returns: int,
    node: OverrideNode,
) -> None:
    """Raise when an impl of an in-place / out= op did not return the tensor it had to write."""
    for ret_index, where in checks:
        expected = kwargs.get(where) if isinstance(where, str) else args[where]
        got = result if n_returns == 1 else result[ret_index]
        if got is not expected:
            name = where if isinstance(where, str) else f"argument {where}"
            raise RuntimeError(
                f"torchgraft override {node.stats_key}: aten::{node.op_symbol} writes its "
                f"result into {name} and must return that same tensor; the impl returned "
                "another object. Write in place (e.g. out.copy_(result)) and return it."
            )


def make_router(
    chain: tuple[OverrideNode, ...],
    fallback: Callable[..., Any],
    guard: RouteGuard,
    checks: tuple[AliasCheck, ...],
    n_returns: int,
) -> Callable[..., Any]:
    """Build the kernel for one (op, key): first matching cond wins, else the kernel below.

    Everything is resolved here, so a call costs a guard check, the cond loop and either the
    impl or ``fallback`` (the captured kernel's ``call_boxed``). Cond exceptions propagate.
    """
    entries = tuple(
        (
            None if node.cond_fn is always_true else node.cond_fn,
            node.impl_fn,
            node.with_keyset,
            node,
        )
        for node in chain
    )

    def router(keyset: torch.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        running = guard.node
        if running is not None:
            # Re-entered from a cond or impl of this (op, key): go to the kernel below.
            if running is not COND_PHASE:
                running.fallbacks += 1  # type: ignore[union-attr]
            return fallback(keyset, *args, **kwargs)
        guard.node = COND_PHASE
        try:
            for cond, impl, with_keyset, node in entries:
                if cond is not None and not cond(*args, **kwargs):
                    node.fallbacks += 1
                    continue
                node.calls += 1
                guard.node = node
                if with_keyset:
                    result = impl(keyset, *args, **kwargs)
                else:
                    result = impl(*args, **kwargs)
                if checks:
                    check_aliases(result, args, kwargs, checks, n_returns, node)
                return result
        finally:
            guard.node = None
        return fallback(keyset, *args, **kwargs)

    return router
