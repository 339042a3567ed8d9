"""torch._native, PyTorch's own override registry, as torchgraft sees it on each torch version.

Every access torchgraft makes to ``torch._native`` goes through this module. Its public functions
(``deregister_op_overrides``, ``reenable_op_overrides``) are called as documented. The private
pieces torchgraft needs to compose with it (the table of registered overrides, the library that
holds its router at one (op, key), the function that rebuilds that router) changed shape between
releases, so they are read through :data:`LAYOUTS`, one row per torch release that torchgraft
has been tested against. On a torch with no row (older than 2.12, or newer than the newest row
without a matching layout) those private pieces count as absent: nothing is guessed, nothing
unpacked blindly; a torch newer than every row is tried against the newest row's layout, and
dropped (with one warning) if it does not have it.

========  =================  ==============================  ===========================
torch     ``_graphs`` key    router library (dict)           rebuild one router
========  =================  ==============================  ===========================
2.11      (no torch._native)
2.12      (op, key)          ``_libs[(op, key)]`` (impls)    ``_cleanup_and_reregister_graph``
2.13      (op, key)          ``_aten_override_libs``         ``_register_overrides_from_graph``
2.14      (op, key)          ``_aten_override_libs``         ``_register_overrides_from_graph``
2.15      (lib, op, key)     ``_override_libs``              ``_register_overrides_from_graph``
========  =================  ==============================  ===========================
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "LAYOUTS",
    "Layout",
    "NativeOverride",
    "active",
    "deregister_op_overrides",
    "layout",
    "overrides",
    "reenable_op_overrides",
    "reinstall",
    "router_token",
    "torch_minor",
]

log = logging.getLogger("torchgraft.registry")

#: (lib_symbol, op_symbol, dispatch_key), torchgraft's own spelling of a graph key.
GraphKey = tuple[str, str, str]


@dataclass(frozen=True)
class Layout:
    """Where one torch release keeps torch._native's private state."""

    #: ``torch._native.registry._graphs`` key for an (lib, op, key).
    graph_key: Callable[[str, str, str], tuple[str, ...]]
    #: The inverse: a ``_graphs`` key as (lib, op, key); None for a key of another shape.
    split_key: Callable[[tuple[Any, ...]], GraphKey | None]
    #: Name of the dict that holds the library with torch._native's kernel at one (op, key).
    libs: str
    #: Rebuilds torch._native's kernel at one (op, key) from its graph, honouring its filters.
    rebuild: Callable[[ModuleType, GraphKey, list[Any]], None]
    #: The private function ``rebuild`` calls (checked to exist before the layout is used).
    rebuild_fn: str


def _split2(key: tuple[Any, ...]) -> GraphKey | None:
    if len(key) == 2 and all(isinstance(part, str) for part in key):
        return ("aten", key[0], key[1])
    return None


def _split3(key: tuple[Any, ...]) -> GraphKey | None:
    if len(key) == 3 and all(isinstance(part, str) for part in key):
        return (key[0], key[1], key[2])
    return None


def _rebuild_212(registry: ModuleType, key: GraphKey, graph: list[Any]) -> None:
    registry._cleanup_and_reregister_graph(
        key[1], key[2], graph, filter_state=registry._filter_state
    )


def _rebuild_213(registry: ModuleType, key: GraphKey, graph: list[Any]) -> None:
    registry._register_overrides_from_graph(
        key[1], key[2], graph, filter_state=registry._filter_state
    )


def _rebuild_215(registry: ModuleType, key: GraphKey, graph: list[Any]) -> None:
    registry._register_overrides_from_graph(*key, graph, filter_state=registry._filter_state)


def _key2(lib: str, op: str, key: str) -> tuple[str, ...]:
    return (op, key)


def _key3(lib: str, op: str, key: str) -> tuple[str, ...]:
    return (lib, op, key)


_LAYOUT_212 = Layout(_key2, _split2, "_libs", _rebuild_212, "_cleanup_and_reregister_graph")
_LAYOUT_213 = Layout(
    _key2, _split2, "_aten_override_libs", _rebuild_213, "_register_overrides_from_graph"
)
_LAYOUT_215 = Layout(
    _key3, _split3, "_override_libs", _rebuild_215, "_register_overrides_from_graph"
)

#: (major, minor) -> layout, for every torch release torchgraft is tested against.
LAYOUTS: dict[tuple[int, int], Layout] = {
    (2, 12): _LAYOUT_212,
    (2, 13): _LAYOUT_213,
    (2, 14): _LAYOUT_213,
    (2, 15): _LAYOUT_215,
}


def torch_minor() -> tuple[int, int]:
    """(major, minor) of the running torch, e.g. (2, 15) for ``2.15.0+cu132``."""
    release = torch.__version__.split("+")[0].split(".")
    return int(release[0]), int(release[1])


@functools.cache
def _registry() -> ModuleType | None:
    """``torch._native.registry``, or None where torch has none (2.11)."""
    if importlib.util.find_spec("torch._native") is None:
        return None
    try:
        import torch._native.registry as registry
    except ImportError:
        return None
    return registry


@functools.cache
def layout() -> Layout | None:
    """The private layout of this torch's torch._native, or None where torchgraft does not know it.

    A torch newer than every row of :data:`LAYOUTS` is tried with the newest row; if it lacks
    one of the names that row reads, torch._native's private state counts as absent here (one
    warning says so) and torchgraft composes with it through its public functions only.
    """
    registry = _registry()
    if registry is None:
        return None
    version = torch_minor()
    found = LAYOUTS.get(version)
    if found is None and version > max(LAYOUTS):
        found = LAYOUTS[max(LAYOUTS)]
    if found is None:
        return None
    needed = ("_graphs", "_filter_state", found.libs, found.rebuild_fn)
    missing = [name for name in needed if not hasattr(registry, name)]
    if missing:
        log.warning(
            "torch %s's torch._native lacks %s: torchgraft will not read its overrides or "
            "rebuild its routers (only its public functions are used)",
            torch.__version__,
            ", ".join(missing),
        )
        return None
    return found


@dataclass(frozen=True)
class NativeOverride:
    """One override registered with torch._native."""

    lib_symbol: str
    op_symbol: str
    dispatch_key: str
    dsl: str
    #: Not switched off by torch._native's filters.
    active: bool

    @property
    def op(self) -> str:
        """Qualified op, e.g. ``"aten::bmm"``."""
        return f"{self.lib_symbol}::{self.op_symbol}"


def _graphs() -> dict[GraphKey, list[Any]]:
    """torch._native's graphs keyed (lib, op, key); keys of an unknown shape are left out."""
    registry, found = _registry(), layout()
    if registry is None or found is None:
        return {}
    result: dict[GraphKey, list[Any]] = {}
    for raw_key, nodes in dict(registry._graphs).items():
        key = found.split_key(raw_key) if isinstance(raw_key, tuple) else None
        if key is not None and isinstance(nodes, list):
            result[key] = nodes
    return result


def overrides() -> list[NativeOverride]:
    """Every override torch._native has registered in this process (none on torch 2.11)."""
    return [
        NativeOverride(
            lib_symbol=lib,
            op_symbol=op,
            dispatch_key=key,
            dsl=str(getattr(node, "dsl_name", "?")),
            active=bool(getattr(node, "active", True)),
        )
        for (lib, op, key), nodes in _graphs().items()
        for node in nodes
    ]


def active(op_symbol: str, dispatch_key: str, lib_symbol: str = "aten") -> bool:
    """Whether torch._native has an active override of ``lib::op_symbol`` at ``dispatch_key``."""
    nodes = _graphs().get((lib_symbol, op_symbol, dispatch_key), [])
    return any(bool(getattr(node, "active", True)) for node in nodes)


def router_token(op_symbol: str, dispatch_key: str, lib_symbol: str = "aten") -> object | None:
    """The library holding torch._native's kernel at (op, key) now, or None when it has none.

    Its identity changes each time torch._native rebuilds that kernel, which is how torchgraft
    tells whether torch._native's router was installed after its own (and so sits above it).
    """
    registry, found = _registry(), layout()
    if registry is None or found is None:
        return None
    libs = getattr(registry, found.libs, None)
    if not isinstance(libs, dict):
        return None
    return libs.get(found.graph_key(lib_symbol, op_symbol, dispatch_key))


def reinstall(op_symbol: str, dispatch_key: str, lib_symbol: str = "aten") -> bool:
    """Make torch._native rebuild its kernel at (op, key), capturing the kernel below it afresh.

    Filters set through torch._native's own functions still apply. Returns whether torch._native
    had overrides there (False changes nothing).
    """
    registry, found = _registry(), layout()
    if registry is None or found is None:
        return False
    key = (lib_symbol, op_symbol, dispatch_key)
    graph = _graphs().get(key)
    if graph is None:
        return False
    found.rebuild(registry, key, graph)
    log.debug("torch._native's kernel at %s::%s/%s rebuilt", lib_symbol, op_symbol, dispatch_key)
    return True


def deregister_op_overrides(op_symbols: Iterable[str]) -> None:
    """torch._native's public ``deregister_op_overrides(disable_op_symbols=...)``."""
    registry = _registry()
    symbols = list(op_symbols)
    if registry is not None and symbols:
        registry.deregister_op_overrides(disable_op_symbols=symbols)


def reenable_op_overrides(op_symbols: Iterable[str]) -> None:
    """torch._native's public ``reenable_op_overrides(enable_op_symbols=...)``."""
    registry = _registry()
    symbols = list(op_symbols)
    if registry is not None and symbols:
        registry.reenable_op_overrides(enable_op_symbols=symbols)
