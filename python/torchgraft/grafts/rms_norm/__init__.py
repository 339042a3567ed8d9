"""RMSNorm in Triton, grafted under ``aten::_fused_rms_norm`` (forward and backward) on CUDA.

Importing this package imports no triton. Contents:

- :func:`rms_norm_reference`, :func:`rms_norm_backward_reference`: the float64-capable
  pure-PyTorch reference (``reference.py``), plus the eager baselines
  :func:`rms_norm_eager_upcast` (Llama-style) and :func:`rms_norm_eager_same_dtype`.
- :func:`register`, :func:`deregister`: the graft through torchgraft's registry.
- ``triton_cond.py`` / ``triton_impl.py``: which calls the kernels take, and running them.
- ``triton_kernels.py``: the kernels and launchers (imports triton).
- :func:`rms_norm`: the same kernels as ``torch.library.triton_op`` custom ops with autograd
  (``triton_op.py``); looking the name up imports triton.
"""

from __future__ import annotations

from typing import Any

from .reference import (
    default_eps,
    rms_norm_backward_reference,
    rms_norm_eager_same_dtype,
    rms_norm_eager_upcast,
    rms_norm_reference,
)
from .registration import deregister, register

__all__ = [
    "default_eps",
    "deregister",
    "register",
    "rms_norm",
    "rms_norm_backward_reference",
    "rms_norm_eager_same_dtype",
    "rms_norm_eager_upcast",
    "rms_norm_reference",
]


def __getattr__(name: str) -> Any:
    # The custom ops are defined on first use: defining a triton_op imports triton.
    if name == "rms_norm":
        from .triton_op import rms_norm

        return rms_norm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
