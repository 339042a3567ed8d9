"""Registers quack's grouped GEMM under ``aten::_grouped_mm`` at CUDA.

The only code that talks to torchgraft's registry for grouped GEMMs. Registering imports no
DSL: the impl imports quack on its first call. Skipped, with an INFO log, when quack-kernels or
CuteDSL is missing or outside the accepted versions
(:func:`torchgraft.dsl.cutedsl.library_unusable_reason`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchgraft.registry import OverrideInfo

__all__ = ["LIBRARY", "OP_SYMBOLS", "ROUTES", "deregister", "notes", "register"]

#: The CuteDSL library the override calls.
LIBRARY = "quack-kernels"
OP_SYMBOLS = ("_grouped_mm",)

#: The routes this package has kernels for.
ROUTES = ("cutedsl",)

_registered: list[OverrideInfo] = []


def register(route: str = "cutedsl") -> None:
    """Installs the conditional quack override of ``aten::_grouped_mm`` at CUDA. Idempotent."""
    if route not in ROUTES:
        raise ValueError(f"unknown grouped_mm route {route!r}; known: {', '.join(ROUTES)}")
    from torchgraft.dsl import cutedsl

    def rows() -> list[cutedsl.OverrideRow]:
        from . import quack_cond, quack_impl

        return [(OP_SYMBOLS[0], quack_cond.grouped_mm_cond, quack_impl.grouped_mm_impl)]

    cutedsl.register_library_overrides(LIBRARY, rows, _registered, "quack grouped_mm override")


def deregister(route: str | None = None) -> None:
    """Removes exactly the override :func:`register` installed; ``route`` None or
    ``"cutedsl"``."""
    from torchgraft import registry

    while _registered:
        registry.remove_override(_registered.pop())


def notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> which calls quack takes`` (for ``torchgraft list``). Imports no
    DSL."""
    from .quack_impl import QUACK

    if QUACK.failed:
        return {("cutedsl", OP_SYMBOLS[0]): f"nothing: import failed ({QUACK.error})"}
    return {
        ("cutedsl", OP_SYMBOLS[0]): "bfloat16 MoE expert GEMMs with offsets on sm90 (2-D x 3-D, "
        "2-D x 2-D as autograd forms them): quack's varlen GEMM, 1.06-1.22x ATen's at the MoE "
        "yardstick's Qwen3-MoE shapes (H200)"
    }
