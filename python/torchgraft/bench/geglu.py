"""The GeGLU benchmark: ``F.gelu(gate, approximate="tanh") * up`` (Gemma's MLP).

The tanh approximation is the one Liger-Kernel's ``LigerGELUMulFunction`` computes (and
transformers' ``gelu_pytorch_tanh``), so every route computes the same function. Routes: the
eager composite, torch.compile of it, torchgraft's fused op (``torchgraft.functional.geglu``)
and Liger's; each is checked against a float64 reference before it is timed. The shapes, bytes
model, inputs and the running of a route are :mod:`.glu`'s.
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
    "APPROXIMATE",
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
    "geglu_eager",
    "make_inputs",
    "reference",
    "routes",
    "run_once",
    "timed_call",
]

OP = "geglu"
OP_SYMBOLS = ("gelu", "mul")
"""The aten ops of the eager composite (torch._native's overrides of them are kept off)."""
BASELINE = "eager"
"""The route the table's speedups are against."""
PEAK_MEMORY = False
"""Whether each call's extra peak memory is recorded (CUDA only)."""
APPROXIMATE = "tanh"
"""``F.gelu``'s approximation benchmarked (Liger's GeGLU has no exact form)."""


def geglu_eager(gate: Tensor, up: Tensor) -> Tensor:
    """GeGLU as Gemma's MLP writes it: ``F.gelu(gate, approximate="tanh") * up``."""
    return F.gelu(gate, approximate=APPROXIMATE) * up


def _torchgraft(gate: Tensor, up: Tensor) -> Tensor:
    from torchgraft import functional as tgf

    return tgf.geglu(gate, up, APPROXIMATE)


GLU = glu.Glu(
    op=OP,
    eager=geglu_eager,
    eager_summary='F.gelu(gate, approximate="tanh") * up: two kernels',
    torchgraft=_torchgraft,
    torchgraft_summary='torchgraft.functional.geglu(gate, up, "tanh"): one fused kernel each way',
    liger_module="ops.geglu",
    liger_function="LigerGELUMulFunction",
)


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[y]`` or ``[y, dgate, dup]``."""
    return glu.reference(GLU, inputs, mode)


def routes() -> tuple[Route, ...]:
    """Every GeGLU route, in table order (the eager baseline first)."""
    return glu.routes(GLU, OP_SYMBOLS)
