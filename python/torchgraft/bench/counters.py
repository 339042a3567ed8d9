"""Counters a benchmark reads: graft calls from every route (which grafts ran, how often), and
dynamo's graphs and graph breaks."""

from __future__ import annotations

import importlib
from types import ModuleType

import torchgraft

__all__ = ["dynamo_graphs", "fired", "graft_counters", "graph_breaks"]


def _registry() -> ModuleType:  # looked up at each call: tests swap the module in sys.modules
    return importlib.import_module("torchgraft.registry")


def graft_counters() -> dict[str, dict[str, int]]:
    """``{"<route>/<op>/<dispatch key>": {"calls": n, "fallbacks": m}}`` for every graft.

    Keys start with the route or DSL name (``"native/..."``, ``"triton/..."``). Combines
    :func:`torchgraft.stats` with the registry's own counters (the same key is counted once).
    """
    counters = {key: dict(value) for key, value in torchgraft.stats().items()}
    for key, value in _registry().override_stats().items():
        counters.setdefault(key, dict(value))
    return counters


def fired(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], prefix: str = ""
) -> dict[str, dict[str, int]]:
    """Counters that grew from ``before`` to ``after`` (keys starting with ``prefix``): deltas."""
    deltas: dict[str, dict[str, int]] = {}
    for key, value in after.items():
        if not key.startswith(prefix):
            continue
        old = before.get(key, {})
        delta = {name: count - old.get(name, 0) for name, count in value.items()}
        if any(delta.values()):
            deltas[key] = delta
    return deltas


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def graph_breaks() -> int:
    """Graph breaks dynamo has taken in this process (every reason, every frame)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return sum(counters["graph_break"].values())
