"""Reading the registry: the overrides, their counters, the filters, and the decomposition
table that carries them into compiled and exported graphs. The state read here is
:mod:`.overrides`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import overrides as state
from .compile import make_compile_router, opaque_op
from .info import FilterState, OverrideInfo, snapshot
from .nodes import OverrideNode, RouteGuard

__all__ = [
    "filter_state",
    "get_dsl_operations",
    "list_overrides",
    "native_decomp_table",
    "override_stats",
    "reset_stats",
]


def list_overrides() -> list[OverrideInfo]:
    """Every registered override (active or not), by (op, key) then registration order."""
    with state._lock:
        return [snapshot(slot, node) for slot in state._slots.values() for node in slot.nodes]


def _node_stats(node: OverrideNode) -> dict[str, float]:
    stats: dict[str, float] = {"calls": node.calls, "fallbacks": node.fallbacks}
    if node.shadow_checks:
        stats["shadow_checks"] = node.shadow_checks
        stats["max_error"] = node.max_error
    return stats


def filter_state() -> FilterState:
    """The DSL names, op symbols and dispatch keys :func:`deregister_op_overrides` has switched
    off (and :func:`reenable_op_overrides` not yet back on)."""
    with state._lock:
        return FilterState(
            frozenset(state._filters.dsl_names),
            frozenset(state._filters.op_symbols),
            frozenset(state._filters.dispatch_keys),
        )


def get_dsl_operations(dsl_name: str, lib_symbol: str = "aten") -> list[str]:
    """The op symbols ``dsl_name`` has overrides for in namespace ``lib_symbol``, sorted.

    torch._native's function of the same name and meaning (one namespace per call: op symbols
    are unique within a namespace, not across them).
    """
    with state._lock:
        return sorted(
            {
                slot.op_symbol
                for slot in state._slots.values()
                if slot.lib_symbol == lib_symbol and any(n.dsl_name == dsl_name for n in slot.nodes)
            }
        )


def override_stats() -> dict[str, dict[str, float]]:
    """``{"<dsl>/<op>/<key>": {"calls": n, "fallbacks": m}}`` for every registered override.

    ``calls`` counts the times the impl was entered (eager router and compiled graphs alike).
    ``fallbacks`` counts the calls this override passed on to what is below it: its cond
    returned False (the call went on to the next override or the previous kernel), or its impl
    called the op again and so reached the previous kernel (the seed's ``_smart_rms_norm`` gate
    for small shapes). Counts are plain integers; under heavy multithreading they may miss a few.

    In strict mode (``TORCHGRAFT_STRICT=1``) an override whose results were compared with the
    kernel below also has ``shadow_checks`` (how many) and ``max_error`` (the largest absolute
    elementwise difference seen; ``inf`` where NaNs, None or shapes disagreed).
    """
    with state._lock:
        return {
            node.stats_key: _node_stats(node)
            for slot in state._slots.values()
            for node in slot.nodes
        }


def reset_stats() -> None:
    """Set every override's counters (and strict-mode errors) back to zero."""
    with state._lock:
        for slot in state._slots.values():
            for node in slot.nodes:
                node.calls = 0
                node.fallbacks = 0
                node.shadow_checks = 0
                node.max_error = 0.0


def _compile_lookup(lib_symbol: str, op_symbol: str) -> Callable[[str], Any]:
    def lookup(dispatch_key: str) -> tuple[tuple[OverrideNode, ...], RouteGuard] | None:
        slot = state._slots.get((lib_symbol, op_symbol, dispatch_key))
        if slot is None or not slot.chain:
            return None
        return slot.chain, slot.guard

    return lookup


def native_decomp_table(overrides_only: bool = False) -> dict[Any, Callable[..., Any]]:
    """Decompositions that carry the active overrides into compiled and exported graphs.

    Each overridden aten overload maps to a "compile router" that, while tracing, picks the
    override the eager router would pick for the arguments' device and emits its opaque op
    ``torchgraft_overrides::<node_id>`` (which runs the impl when the graph runs); with no match
    it returns NotImplemented so the op is traced as usual. Use it with
    ``ExportedProgram.run_decompositions(native_decomp_table())`` or as the ``decompositions`` of
    a torch.compile backend (e.g. ``aot_autograd(..., decompositions=native_decomp_table())``).

    Args:
        overrides_only: Only the override entries; otherwise they are layered over
            ``torch.export.default_decompositions()`` and win on conflicts.
    """
    table: dict[Any, Callable[..., Any]] = {}
    if not overrides_only:
        from torch.export import default_decompositions

        table.update(default_decompositions())
    with state._lock:
        for slot in state._slots.values():
            overload = slot.overload
            if not slot.chain or overload is None:
                continue
            for node in slot.chain:
                opaque_op(node, overload, slot.guard)  # define outside of any tracing
            router = state._compile_routers.get(overload)
            if router is None:
                lookup = _compile_lookup(slot.lib_symbol, slot.op_symbol)
                router = make_compile_router(overload, lookup)
                state._compile_routers[overload] = router
            table[overload] = router
    return table
