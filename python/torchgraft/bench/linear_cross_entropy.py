"""The fused linear cross-entropy benchmark: an lm head and its loss, ``hidden @ weight.T``
then cross-entropy, with or without the ``(tokens, vocab)`` logits in memory.

hidden ``(tokens, H)``, weight ``(vocab, H)`` (scaled by ``H ** -0.5``, so the logits are of
order 1), int64 targets with one row in 8 ignored. Forward + backward differentiates to hidden
and weight. Routes: eager (``F.linear``, then ``F.cross_entropy`` with transformers' float32
upcast), torch.compile of it, torchgraft's chunked op (``torchgraft.functional.
linear_cross_entropy``) and Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``. Three GEMMs
dominate the time (``2 * tokens * H * vocab`` flop each), so the bytes model is only the
inputs read and the gradients written; the figures that matter are the time and each call's
extra peak memory (recorded on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgraft.ops.linear_cross_entropy.reference import linear_cross_entropy_reference

from .fused_common import (
    IGNORE_INDEX,
    TORCHGRAFT_GRAFTS,
    at_least_float32,
    compiled,
    default_dtype,
    liger_attr,
    liger_unavailable,
    loss_tensor,
    make_generator,
    make_target,
    randn,
    torchgraft_unavailable,
)
from .problem import ShapedProblem
from .routes import Route, always_available, stock_dispatch

__all__ = [
    "BASELINE",
    "MODES",
    "OP",
    "PEAK_MEMORY",
    "TOLERANCE",
    "Inputs",
    "LinearCrossEntropyFn",
    "Problem",
    "bytes_moved",
    "check_shape",
    "default_dtype",
    "default_shapes",
    "linear_cross_entropy_eager",
    "make_inputs",
    "reference",
    "routes",
    "run_once",
    "timed_call",
]

OP = "linear_cross_entropy"
OP_SYMBOLS = (
    "mm",
    "_log_softmax",
    "_log_softmax_backward_data",
    "nll_loss_forward",
    "nll_loss_backward",
)
"""The aten ops of the eager route (torch._native's overrides of them are kept off)."""
MODES = ("fwd", "fwd+bwd")
"""``fwd``: the loss alone (no grad); ``fwd+bwd``: the loss, then its gradients to hidden and
weight."""
BASELINE = "eager"
"""The route the table's speedups are against."""
PEAK_MEMORY = True
"""Each call's extra peak memory is recorded (CUDA only)."""

# As fused_common.TOLERANCE, with room in bf16/fp16 for the weight gradient accumulated in the
# weight's dtype, one rounding per chunk of rows (torchgraft's and Liger's default).
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 1e-2,
}

LinearCrossEntropyFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``fn(hidden, weight, target) -> loss``: mean over the rows whose target is not ignored."""


@dataclass(frozen=True)
class Problem(ShapedProblem):
    """One benchmark problem: ``(tokens, hidden, vocab)``, dtype, device."""

    @property
    def tokens(self) -> int:
        """Rows of hidden states."""
        return self.shape[0]

    @property
    def hidden(self) -> int:
        """Hidden size H."""
        return self.shape[1]

    @property
    def vocab(self) -> int:
        """Vocabulary size (rows of the weight)."""
        return self.shape[2]


HEADLINE_SHAPE = (8192, 2048, 128256)
"""8192 tokens, Llama-3.2-1B's lm head: 2048 -> 128256 (the README's headline)."""


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """The sweep run when ``--shapes`` is not given (tokens x hidden x vocab)."""
    if device.type == "cpu":
        return (
            [(64, 64, 1000), (128, 128, 4096)] if quick else [(512, 256, 8192), (1024, 512, 16000)]
        )
    if quick:
        return [HEADLINE_SHAPE]
    return [(4096, 2048, 128256), HEADLINE_SHAPE, (8192, 4096, 128256)]


def check_shape(shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` is not ``tokens x hidden x vocab``, or None."""
    return None if len(shape) == 3 else "expected tokens x hidden x vocab, e.g. 8192x2048x128256"


def bytes_moved(problem: Problem, mode: str) -> int:
    """Bytes of the inputs read and gradients written, nothing for the logits (a fused kernel
    keeps them on chip): hidden, weight and targets once forward; forward + backward reads
    hidden and weight again and writes their gradients."""
    inputs = (problem.tokens + problem.vocab) * problem.hidden * problem.dtype.itemsize
    target = problem.tokens * 8
    return (inputs if mode == "fwd" else 3 * inputs) + target


# ---- inputs, reference, running a route --------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """A problem's hidden states, lm-head weight and targets (random, fixed seed)."""

    hidden: Tensor
    weight: Tensor
    target: Tensor

    @property
    def x(self) -> Tensor:
        """The tensor whose copy is timed as the bandwidth ceiling (the weight, the largest)."""
        return self.weight


def make_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """Standard normal hidden states, a weight scaled by ``H ** -0.5``, targets (1 in 8
    ignored)."""
    gen = make_generator(problem.device, seed)
    p, dtype, device = problem, problem.dtype, problem.device
    return Inputs(
        hidden=randn((p.tokens, p.hidden), dtype, device, gen),
        weight=randn((p.vocab, p.hidden), dtype, device, gen, scale=p.hidden**-0.5),
        target=make_target(p.tokens, p.vocab, device, gen),
    )


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[loss]`` or ``[loss, dhidden, dweight]``."""
    hidden = inputs.hidden.detach().double().requires_grad_(mode != "fwd")
    weight = inputs.weight.detach().double().requires_grad_(mode != "fwd")
    loss = linear_cross_entropy_reference(hidden, weight, inputs.target, None, IGNORE_INDEX)
    if mode == "fwd":
        return [loss.detach()]
    dhidden, dweight = torch.autograd.grad(loss, (hidden, weight))
    return [loss.detach(), dhidden, dweight]


def _own_copies(inputs: Inputs, mode: str) -> tuple[Tensor, Tensor]:
    # Every route gets its own hidden and weight (as the other ops' routes do).
    hidden = inputs.hidden.clone().requires_grad_(mode != "fwd")
    weight = inputs.weight.clone().requires_grad_(mode != "fwd")
    return hidden, weight


def run_once(fn: LinearCrossEntropyFn, inputs: Inputs, mode: str) -> list[Tensor]:
    """The route's results for ``mode``, in the order :func:`reference` returns them."""
    hidden, weight = _own_copies(inputs, mode)
    if mode == "fwd":
        with torch.no_grad():
            return [fn(hidden, weight, inputs.target)]
    loss = fn(hidden, weight, inputs.target)
    dhidden, dweight = torch.autograd.grad(loss, (hidden, weight))
    return [loss.detach(), dhidden, dweight]


def timed_call(fn: LinearCrossEntropyFn, inputs: Inputs, mode: str) -> Callable[[], object]:
    """A no-argument callable running ``mode`` once (what the timer calls)."""
    hidden, weight = _own_copies(inputs, mode)
    target = inputs.target
    if mode == "fwd":

        def forward() -> object:
            with torch.no_grad():
                return fn(hidden, weight, target)

        return forward

    def forward_backward() -> object:
        return torch.autograd.grad(fn(hidden, weight, target), (hidden, weight))

    return forward_backward


# ---- the routes ------------------------------------------------------------------------------


def linear_cross_entropy_eager(hidden: Tensor, weight: Tensor, target: Tensor) -> Tensor:
    """An lm head and its loss as transformers runs them: ``F.linear``, then
    ``F.cross_entropy`` of the logits upcast to float32 (the logits exist twice; float64 stays
    float64)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(at_least_float32(logits), target, ignore_index=IGNORE_INDEX)


def _build_eager(_problem: Problem) -> LinearCrossEntropyFn:
    return linear_cross_entropy_eager


def _build_compile(_problem: Problem) -> LinearCrossEntropyFn:
    return compiled(linear_cross_entropy_eager)


def _build_torchgraft(_problem: Problem) -> LinearCrossEntropyFn:
    from torchgraft import functional as tgf

    def torchgraft(hidden: Tensor, weight: Tensor, target: Tensor) -> Tensor:
        return tgf.linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE_INDEX)

    return torchgraft


def _build_liger(_problem: Problem) -> LinearCrossEntropyFn:
    loss_class = liger_attr(
        "transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss"
    )
    loss_fn = loss_class(ignore_index=IGNORE_INDEX)

    def liger(hidden: Tensor, weight: Tensor, target: Tensor) -> Tensor:
        return loss_tensor(loss_fn(weight, hidden, target))  # Liger takes the weight first

    return liger


def routes() -> tuple[Route, ...]:
    """Every linear cross-entropy route, in table order (the eager baseline first). All run
    with torchgraft's grafts off: the torchgraft route calls its operator directly."""
    stock = functools.partial(stock_dispatch, OP_SYMBOLS)
    return (
        Route(
            "eager",
            "F.linear, then F.cross_entropy(logits.float(), target) (transformers' upcast)",
            always_available,
            _build_eager,
            stock,
        ),
        Route(
            "compile",
            "torch.compile of the eager route (static shapes)",
            always_available,
            _build_compile,
            stock,
        ),
        Route(
            "torchgraft",
            "torchgraft.functional.linear_cross_entropy: chunks of rows, no full logits",
            torchgraft_unavailable,
            _build_torchgraft,
            stock,
            graft_prefix=TORCHGRAFT_GRAFTS,
        ),
        Route(
            "liger",
            "Liger-Kernel's LigerFusedLinearCrossEntropyLoss (chunked, no full logits)",
            liger_unavailable,
            _build_liger,
            stock,
        ),
    )
