"""Registers the RMSNorm kernels under ``aten::_fused_rms_norm`` and its backward at CUDA.

Kept in one small module: it is the only code that talks to torchgraft's registry. One row
per (route, op): the Triton kernels (route ``"triton"``), quack's CuteDSL kernels
(``"cutedsl"``), the Helion kernels (``"helion"``) and the cuTile kernels (``"cutile"``).
Registering imports no DSL; the impls import theirs on their first call. A route whose DSL (or
kernel library) is missing or outside the accepted versions is skipped with an INFO log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchgraft.registry import OverrideInfo

__all__ = ["OP_SYMBOLS", "ROUTES", "deregister", "register"]

log = logging.getLogger("torchgraft.grafts.rms_norm")

OP_SYMBOLS = ("_fused_rms_norm", "_fused_rms_norm_backward")
#: The routes this package has kernels for.
ROUTES = ("triton", "cutedsl", "helion", "cutile")

Row = tuple[str, Callable[..., bool], Callable[..., Any]]

_registered: dict[str, list[OverrideInfo]] = {}


def _rows(route: str) -> tuple[Row, ...]:
    """``(op, cond, impl)`` for each op of ``route`` (imports the conds and impls, not DSLs)."""
    if route == "triton":
        from .triton_cond import fused_rms_norm_backward_cond, fused_rms_norm_cond
        from .triton_impl import fused_rms_norm_backward_impl, fused_rms_norm_impl

        return (
            (OP_SYMBOLS[0], fused_rms_norm_cond, fused_rms_norm_impl),
            (OP_SYMBOLS[1], fused_rms_norm_backward_cond, fused_rms_norm_backward_impl),
        )
    from . import dsl_cond, dsl_impl

    if route == "cutedsl":
        return (
            (OP_SYMBOLS[0], dsl_cond.quack_forward_cond, dsl_impl.quack_forward_impl),
            (OP_SYMBOLS[1], dsl_cond.quack_backward_cond, dsl_impl.quack_backward_impl),
        )
    if route == "cutile":
        return (
            (OP_SYMBOLS[0], dsl_cond.cutile_forward_cond, dsl_impl.cutile_forward_impl),
            (OP_SYMBOLS[1], dsl_cond.cutile_backward_cond, dsl_impl.cutile_backward_impl),
        )
    return (
        (OP_SYMBOLS[0], dsl_cond.helion_forward_cond, dsl_impl.helion_forward_impl),
        (OP_SYMBOLS[1], dsl_cond.helion_backward_cond, dsl_impl.helion_backward_impl),
    )


def _unusable_reason(route: str) -> str | None:
    if route == "cutedsl":
        from torchgraft.dsl import cutedsl

        return cutedsl.library_unusable_reason("quack-kernels")
    return None  # triton, helion, cutile: the DSL helper's own gate (register_op_override) decides


def register(route: str = "triton") -> None:
    """Installs the conditional overrides of both ops for ``route`` at the CUDA dispatch key.

    Skipped (with an INFO log) when the route's DSL or kernel library is missing or outside
    the accepted versions. Idempotent per route.
    """
    if route not in ROUTES:
        raise ValueError(f"unknown RMSNorm route {route!r}; known: {', '.join(ROUTES)}")
    from torchgraft import registry

    live = {o.node_id for o in registry.list_overrides()}
    if [info for info in _registered.get(route, []) if info.node_id in live]:
        return
    reason = _unusable_reason(route)
    if reason is not None:
        log.info("RMSNorm %s overrides not registered: %s", route, reason)
        return
    from torchgraft import dsl

    helper = dsl.DSLS[route]
    infos = [
        info
        for op_symbol, cond, impl in _rows(route)
        if (info := helper.register_op_override("aten", op_symbol, "CUDA", cond, impl)) is not None
    ]
    _registered[route] = infos


def deregister(route: str | None = None) -> None:
    """Removes exactly the overrides :func:`register` installed for ``route`` (every route
    when None); other overrides stay."""
    from torchgraft import registry

    for name in ROUTES if route is None else (route,):
        infos = _registered.pop(name, [])
        while infos:
            registry.remove_override(infos.pop())


def notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> why the route takes the calls it takes`` (for ``torchgraft list``).

    Imports no DSL."""
    from .dsl_cond import CUTILE_MAX_HIDDEN, HELION_MAX_HIDDEN, QUACK_MAX_HIDDEN
    from .dsl_impl import CUTILE, HELION, QUACK

    why = {
        "triton": "where measured faster than ATen on an H100 (triton_crossover.py)",
        "cutedsl": f"every shape quack takes (sm90/sm100, hidden <= {QUACK_MAX_HIDDEN}); opt-in",
        "helion": (
            f"with a weight, hidden <= {HELION_MAX_HIDDEN}, configs from helion_configs.json; "
            "opt-in"
        ),
        "cutile": (
            f"with a weight, hidden <= {CUTILE_MAX_HIDDEN}, a GPU its tileiras compiles for "
            "(sm90 from 13.3); opt-in"
        ),
    }
    for route, kernels in (("cutedsl", QUACK), ("helion", HELION), ("cutile", CUTILE)):
        if kernels.failed:
            why[route] = f"nothing: import failed ({kernels.error})"
    return {(route, op): text for route, text in why.items() for op in OP_SYMBOLS}
