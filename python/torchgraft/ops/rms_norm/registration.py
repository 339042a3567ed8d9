"""Registers the Triton RMSNorm under ``aten::_fused_rms_norm`` and its backward at CUDA.

Kept in one small module: it is the only code that talks to torchgraft's registry.
Registering imports no triton; the impls import it on their first call.
"""

from __future__ import annotations

__all__ = ["OP_SYMBOLS", "deregister", "register"]

OP_SYMBOLS = ("_fused_rms_norm", "_fused_rms_norm_backward")


def register() -> None:
    """Installs the conditional Triton overrides of both ops at the CUDA dispatch key."""
    from torchgraft.dsl import triton as triton_dsl

    from .cond import fused_rms_norm_backward_cond, fused_rms_norm_cond
    from .impl import fused_rms_norm_backward_impl, fused_rms_norm_impl

    triton_dsl.register_op_override(
        "aten", "_fused_rms_norm", "CUDA", fused_rms_norm_cond, fused_rms_norm_impl
    )
    triton_dsl.register_op_override(
        "aten",
        "_fused_rms_norm_backward",
        "CUDA",
        fused_rms_norm_backward_cond,
        fused_rms_norm_backward_impl,
    )


def deregister() -> None:
    """Removes the overrides of both ops.

    The registry's filters (as in ``torch._native``) add up: naming the op symbols disables
    every override of these two ops, which today are only this package's. Naming the DSL as
    well would also disable every other Triton override.
    """
    from torchgraft import registry

    registry.deregister_op_overrides(disable_op_symbols=list(OP_SYMBOLS))
