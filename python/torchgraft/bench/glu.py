"""The gated linear units' benchmark, shared by :mod:`.swiglu` and :mod:`.geglu`.

``y = act(gate) * up`` elementwise, gate and up of one shape (rows x width: an MLP's two
projections). What differs between SwiGLU and GeGLU (the activation, torchgraft's op, Liger's
function) is one :class:`Glu` value; the two op modules bind it to this module's functions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .fused_common import (
    ELEMENTWISE_PASSES,
    TORCHGRAFT_GRAFTS,
    compiled,
    liger_attr,
    liger_unavailable,
    make_generator,
    randn,
    torchgraft_unavailable,
)
from .problem import ShapedProblem
from .routes import Route, always_available, stock_dispatch

__all__ = ["MODES", "PASSES", "Glu", "GluFn", "Inputs", "Problem"]

MODES = ("fwd", "fwd+bwd")
"""``fwd``: the forward alone; ``fwd+bwd``: forward, then backward to gate and up."""

PASSES = ELEMENTWISE_PASSES

GluFn = Callable[[Tensor, Tensor], Tensor]
"""``fn(gate, up) -> act(gate) * up``."""


@dataclass(frozen=True)
class Glu:
    """One gated unit: its eager formula, float64 reference, torchgraft op and Liger function."""

    op: str
    eager: GluFn
    """The composite models write (e.g. ``F.silu(gate) * up``); also the float64 reference."""
    eager_summary: str
    torchgraft: GluFn
    torchgraft_summary: str
    liger_module: str
    liger_function: str


@dataclass(frozen=True)
class Problem(ShapedProblem):
    """One benchmark problem: the shape of gate (and up), dtype, device."""

    @property
    def width(self) -> int:
        """Size of the last dim (the MLP's intermediate size)."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Number of rows (tokens)."""
        return math.prod(self.shape[:-1])


HEADLINE_SHAPE = (8192, 8192)
"""The README's SwiGLU headline: 8192 tokens x an 8192-wide MLP."""


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """The sweep run when ``--shapes`` is not given (rows x width)."""
    if device.type == "cpu":
        return [(64, 256), (256, 1024)] if quick else [(256, 1024), (1024, 4096), (2048, 4096)]
    if quick:
        return [(4096, 4096), HEADLINE_SHAPE]
    return [(4096, 4096), (4096, 14336), HEADLINE_SHAPE, (16384, 8192), (8192, 14336)]


def check_shape(shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` is not a gate shape (any shape is), or None."""
    return None


def bytes_moved(problem: Problem, mode: str) -> int:
    """Bytes an ideal kernel moves: forward reads gate and up and writes y (3 tensors);
    forward + backward adds reading dy, gate and up and writing their gradients (8 in all)."""
    size = problem.rows * problem.width * problem.dtype.itemsize
    return 3 * size if mode == "fwd" else 8 * size


# ---- inputs, reference, running a route --------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """A problem's gate, up and output gradient (random, fixed seed)."""

    gate: Tensor
    up: Tensor
    grad_out: Tensor

    @property
    def x(self) -> Tensor:
        """The tensor whose copy is timed as the bandwidth ceiling (gate)."""
        return self.gate


def make_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """Random inputs of the problem's dtype on its device; gate spread over [-6, 6] or so, where
    the activation bends."""
    gen = make_generator(problem.device, seed)
    shape, dtype, device = problem.shape, problem.dtype, problem.device
    return Inputs(
        gate=randn(shape, dtype, device, gen, scale=2.0),
        up=randn(shape, dtype, device, gen),
        grad_out=randn(shape, dtype, device, gen),
    )


def reference(glu: Glu, inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[y]`` or ``[y, dgate, dup]``."""
    gate = inputs.gate.detach().double().requires_grad_(mode != "fwd")
    up = inputs.up.detach().double().requires_grad_(mode != "fwd")
    y = glu.eager(gate, up)
    if mode == "fwd":
        return [y.detach()]
    dgate, dup = torch.autograd.grad(y, (gate, up), inputs.grad_out.double())
    return [y.detach(), dgate, dup]


def _own_copies(inputs: Inputs, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    # Every route gets its own gate, up and dy: Liger's backward writes the gradients over gate
    # and up (and nothing a route does may reach the next route's inputs).
    gate, up = inputs.gate.clone(), inputs.up.clone()
    if mode != "fwd":
        gate.requires_grad_()
        up.requires_grad_()
    return gate, up, inputs.grad_out.clone()


def run_once(fn: GluFn, inputs: Inputs, mode: str) -> list[Tensor]:
    """The route's results for ``mode``, in the order :func:`reference` returns them."""
    gate, up, grad_out = _own_copies(inputs, mode)
    if mode == "fwd":
        with torch.no_grad():
            return [fn(gate, up)]
    y = fn(gate, up)
    out = y.detach().clone()  # before a backward that may write over its inputs
    dgate, dup = torch.autograd.grad(y, (gate, up), grad_out)
    return [out, dgate, dup]


def timed_call(fn: GluFn, inputs: Inputs, mode: str) -> Callable[[], object]:
    """A no-argument callable running ``mode`` once (what the timer calls). An in-place route
    is timed on its previous call's output, which costs the same."""
    gate, up, grad_out = _own_copies(inputs, mode)
    if mode == "fwd":

        def forward() -> object:
            with torch.no_grad():
                return fn(gate, up)

        return forward

    def forward_backward() -> object:
        return torch.autograd.grad(fn(gate, up), (gate, up), grad_out)

    return forward_backward


# ---- the routes ------------------------------------------------------------------------------


def routes(glu: Glu, op_symbols: tuple[str, ...]) -> tuple[Route, ...]:
    """Every route of ``glu``, in table order (the eager baseline first). All run with
    torchgraft's grafts off: the torchgraft route calls its operator directly."""

    def build_eager(_problem: Problem) -> GluFn:
        return glu.eager

    def build_compile(_problem: Problem) -> GluFn:
        return compiled(glu.eager)

    def build_torchgraft(_problem: Problem) -> GluFn:
        return glu.torchgraft

    def build_liger(_problem: Problem) -> GluFn:
        function = liger_attr(glu.liger_module, glu.liger_function)

        def liger(gate: Tensor, up: Tensor) -> Tensor:
            return function.apply(gate, up)

        return liger

    stock = functools.partial(stock_dispatch, op_symbols)
    return (
        Route("eager", glu.eager_summary, always_available, build_eager, stock),
        Route(
            "compile",
            "torch.compile of the eager composite (static shapes)",
            always_available,
            build_compile,
            stock,
        ),
        Route(
            "torchgraft",
            glu.torchgraft_summary,
            torchgraft_unavailable,
            build_torchgraft,
            stock,
            graft_prefix=TORCHGRAFT_GRAFTS,
        ),
        Route(
            "liger",
            f"Liger-Kernel's {glu.liger_function} (backward writes the gradients over gate, up)",
            liger_unavailable,
            build_liger,
            stock,
        ),
    )
