"""The SwiGLU benchmark: ``F.silu(gate) * up``, gate and up of one shape (rows x width).

Routes: the eager composite, torch.compile of it, torchgraft's fused op
(``torchgraft.functional.swiglu``) and Liger-Kernel's ``LigerSiLUMulFunction``; each is checked
against a float64 reference before it is timed. The shapes, bytes model, inputs and the running
of a route are :mod:`.glu`'s.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from . import glu
from .fused_common import TOLERANCE, default_dtype
from .glu import (
    MODES,
    PASSES,
    Inputs,
    Problem,
    bytes_moved,
    check_shape,
    default_shapes,
    make_inputs,
    run_once,
    timed_call,
)
from .routes import Route

__all__ = [
    "BASELINE",
    "MODES",
    "OP",
    "PASSES",
    "PEAK_MEMORY",
    "TOLERANCE",
    "Inputs",
    "Problem",
    "bytes_moved",
    "check_shape",
    "default_dtype",
    "default_shapes",
    "make_inputs",
    "reference",
    "routes",
    "run_once",
    "swiglu_eager",
    "timed_call",
]

OP = "swiglu"
OP_SYMBOLS = ("silu", "mul")
"""The aten ops of the eager composite (torch._native's overrides of them are kept off)."""
BASELINE = "eager"
"""The route the table's speedups are against."""
PEAK_MEMORY = False
"""Whether each call's extra peak memory is recorded (CUDA only)."""


def swiglu_eager(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU as Llama's MLP writes it: ``F.silu(gate) * up`` (two kernels)."""
    return F.silu(gate) * up


def _torchgraft(gate: Tensor, up: Tensor) -> Tensor:
    from torchgraft import functional as tgf

    return tgf.swiglu(gate, up)


GLU = glu.Glu(
    op=OP,
    eager=swiglu_eager,
    eager_summary="F.silu(gate) * up: two kernels",
    torchgraft=_torchgraft,
    torchgraft_summary="torchgraft.functional.swiglu: one fused kernel each way",
    liger_module="ops.swiglu",
    liger_function="LigerSiLUMulFunction",
)


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[y]`` or ``[y, dgate, dup]``."""
    return glu.reference(GLU, inputs, mode)


def routes() -> tuple[Route, ...]:
    """Every SwiGLU route, in table order (the eager baseline first)."""
    return glu.routes(GLU, OP_SYMBOLS)
