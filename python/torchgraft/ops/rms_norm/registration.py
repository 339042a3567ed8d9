"""Registers the Triton RMSNorm under ``aten::_fused_rms_norm`` and its backward at CUDA.

Kept in one small module: it is the only code that talks to torchgraft's registry.
Registering imports no triton; the impls import it on their first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchgraft.registry import OverrideInfo

__all__ = ["OP_SYMBOLS", "deregister", "register"]

OP_SYMBOLS = ("_fused_rms_norm", "_fused_rms_norm_backward")

_registered: list[OverrideInfo] = []


def register() -> None:
    """Installs the conditional Triton overrides of both ops at the CUDA dispatch key.

    Skipped (with an INFO log from the registry) when triton is missing or too old.
    Idempotent.
    """
    if _registered:
        return
    from torchgraft.dsl import triton as triton_dsl

    from .cond import fused_rms_norm_backward_cond, fused_rms_norm_cond
    from .impl import fused_rms_norm_backward_impl, fused_rms_norm_impl

    for op_symbol, cond, impl in (
        ("_fused_rms_norm", fused_rms_norm_cond, fused_rms_norm_impl),
        ("_fused_rms_norm_backward", fused_rms_norm_backward_cond, fused_rms_norm_backward_impl),
    ):
        info = triton_dsl.register_op_override("aten", op_symbol, "CUDA", cond, impl)
        if info is not None:
            _registered.append(info)


def deregister() -> None:
    """Removes exactly the overrides :func:`register` installed (other overrides stay)."""
    from torchgraft import registry

    while _registered:
        registry.remove_override(_registered.pop())
