"""Registers FA4 under the SDPA ops (flash and cuDNN, forward and backward) at CUDA.

The only code that talks to torchgraft's registry for attention. Registering imports no
DSL: the impls import FA4 on their first call. Skipped, with an INFO log, when
flash-attn-4 or CuteDSL is missing or outside the accepted versions
(:func:`torchgraft.dsl.cutedsl.library_unusable_reason`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchgraft.registry import OverrideInfo

__all__ = ["LIBRARY", "OP_SYMBOLS", "ROUTES", "deregister", "register"]

#: The CuteDSL library these overrides call.
LIBRARY = "flash-attn-4"
OP_SYMBOLS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
)

#: The routes this package has kernels for.
ROUTES = ("cutedsl",)

_registered: list[OverrideInfo] = []


def register(route: str = "cutedsl") -> None:
    """Installs the conditional FA4 overrides of the four SDPA ops at CUDA. Idempotent."""
    if route not in ROUTES:
        raise ValueError(f"unknown attention route {route!r}; known: {', '.join(ROUTES)}")
    from torchgraft.dsl import cutedsl

    def rows() -> list[cutedsl.OverrideRow]:
        from . import fa4_cond, fa4_impl

        return [
            (OP_SYMBOLS[0], fa4_cond.flash_attention_cond, fa4_impl.flash_attention_impl),
            (
                OP_SYMBOLS[1],
                fa4_cond.flash_attention_backward_cond,
                fa4_impl.flash_attention_backward_impl,
            ),
            (OP_SYMBOLS[2], fa4_cond.cudnn_attention_cond, fa4_impl.cudnn_attention_impl),
            (
                OP_SYMBOLS[3],
                fa4_cond.cudnn_attention_backward_cond,
                fa4_impl.cudnn_attention_backward_impl,
            ),
        ]

    cutedsl.register_library_overrides(LIBRARY, rows, _registered, "FA4 attention overrides")


def deregister(route: str | None = None) -> None:
    """Removes exactly the overrides :func:`register` installed (other overrides stay);
    ``route`` None or ``"cutedsl"``."""
    from torchgraft import registry

    while _registered:
        registry.remove_override(_registered.pop())


def notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> why FA4 takes the calls it takes`` (for ``torchgraft list``).

    Imports no DSL."""
    from . import crossover
    from .fa4_impl import FA4

    text = crossover.summary() if not FA4.failed else f"nothing: import failed ({FA4.error})"
    return {("cutedsl", op): text for op in OP_SYMBOLS}
