"""The cross-entropy benchmark: a language model's loss over ``(rows, vocab)`` logits.

The targets are int64 class indices, one row in 8 set to ``ignore_index=-100`` (padding); the
loss is the mean over the other rows. Forward + backward differentiates to the logits. Routes:
``F.cross_entropy`` on the logits as they are, the same with the float32 upcast transformers
does (``logits.float()``), torch.compile of that, torchgraft's fused op
(``torchgraft.functional.cross_entropy``) and Liger-Kernel's ``LigerCrossEntropyLoss`` (which
writes the gradient over the logits: every route gets its own copy of them). Each call's extra
peak memory is recorded on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgraft.ops.cross_entropy.reference import cross_entropy_reference

from .fused_common import (
    IGNORE_INDEX,
    TOLERANCE,
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
    "CrossEntropyFn",
    "Inputs",
    "Problem",
    "bytes_moved",
    "check_shape",
    "cross_entropy_upcast",
    "default_dtype",
    "default_shapes",
    "make_inputs",
    "reference",
    "routes",
    "run_once",
    "timed_call",
]

OP = "cross_entropy"
OP_SYMBOLS = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")
"""The aten ops of ``F.cross_entropy`` (torch._native's overrides of them are kept off)."""
MODES = ("fwd", "fwd+bwd")
"""``fwd``: the loss alone (no grad); ``fwd+bwd``: the loss, then its gradient to the logits."""
BASELINE = "eager"
"""The route the table's speedups are against."""
PEAK_MEMORY = True
"""Each call's extra peak memory is recorded (CUDA only)."""

CrossEntropyFn = Callable[[Tensor, Tensor], Tensor]
"""``fn(logits, target) -> loss``: mean over the rows whose target is not ignored."""


@dataclass(frozen=True)
class Problem(ShapedProblem):
    """One benchmark problem: ``(rows, vocab)`` logits, dtype, device."""

    @property
    def rows(self) -> int:
        """Tokens (rows of logits)."""
        return self.shape[0]

    @property
    def vocab(self) -> int:
        """Classes (the vocabulary)."""
        return self.shape[1]


HEADLINE_SHAPE = (8192, 128256)
"""8192 tokens x Llama-3's vocabulary (the README's headline)."""


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """The sweep run when ``--shapes`` is not given (rows x vocab)."""
    if device.type == "cpu":
        return [(64, 1000), (256, 4096)] if quick else [(512, 32000), (2048, 32000)]
    if quick:
        return [HEADLINE_SHAPE]
    return [(8192, 32000), (4096, 128256), HEADLINE_SHAPE]


def check_shape(shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` is not ``rows x vocab``, or None."""
    return None if len(shape) == 2 else "expected rows x vocab, e.g. 8192x128256"


def bytes_moved(problem: Problem, mode: str) -> int:
    """Bytes an ideal kernel moves, with the targets: the forward reads the logits once; forward
    + backward reads them twice (row max and sum, then the gradient) and writes the gradient:
    three passes."""
    logits = problem.rows * problem.vocab * problem.dtype.itemsize
    target = problem.rows * 8
    return (logits if mode == "fwd" else 3 * logits) + target


# ---- inputs, reference, running a route --------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """A problem's logits and targets (random, fixed seed)."""

    logits: Tensor
    target: Tensor

    @property
    def x(self) -> Tensor:
        """The tensor whose copy is timed as the bandwidth ceiling (the logits)."""
        return self.logits


def make_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """Standard normal logits and random targets, one row in 8 ignored."""
    gen = make_generator(problem.device, seed)
    return Inputs(
        logits=randn(problem.shape, problem.dtype, problem.device, gen),
        target=make_target(problem.rows, problem.vocab, problem.device, gen),
    )


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[loss]`` or ``[loss, dlogits]``."""
    logits = inputs.logits.detach().double().requires_grad_(mode != "fwd")
    loss = cross_entropy_reference(logits, inputs.target, IGNORE_INDEX)
    if mode == "fwd":
        return [loss.detach()]
    (dlogits,) = torch.autograd.grad(loss, logits)
    return [loss.detach(), dlogits]


def _own_logits(inputs: Inputs, mode: str) -> Tensor:
    # Every route gets its own logits: Liger writes the gradient over them.
    return inputs.logits.clone().requires_grad_(mode != "fwd")


def run_once(fn: CrossEntropyFn, inputs: Inputs, mode: str) -> list[Tensor]:
    """The route's results for ``mode``, in the order :func:`reference` returns them."""
    logits = _own_logits(inputs, mode)
    if mode == "fwd":
        with torch.no_grad():
            return [fn(logits, inputs.target)]
    loss = fn(logits, inputs.target)
    (dlogits,) = torch.autograd.grad(loss, logits)
    return [loss.detach(), dlogits]


def timed_call(fn: CrossEntropyFn, inputs: Inputs, mode: str) -> Callable[[], object]:
    """A no-argument callable running ``mode`` once (what the timer calls). An in-place route
    is timed on its previous call's output (the gradient), which costs the same."""
    logits, target = _own_logits(inputs, mode), inputs.target
    if mode == "fwd":

        def forward() -> object:
            with torch.no_grad():
                return fn(logits, target)

        return forward

    def forward_backward() -> object:
        return torch.autograd.grad(fn(logits, target), logits)

    return forward_backward


# ---- the routes ------------------------------------------------------------------------------


def cross_entropy_upcast(logits: Tensor, target: Tensor) -> Tensor:
    """The loss as transformers computes it: ``F.cross_entropy(logits.float(), target)`` (float64
    logits stay float64)."""
    return F.cross_entropy(at_least_float32(logits), target, ignore_index=IGNORE_INDEX)


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def _build_eager(_problem: Problem) -> CrossEntropyFn:
    return _cross_entropy


def _build_upcast(_problem: Problem) -> CrossEntropyFn:
    return cross_entropy_upcast


def _build_compile(_problem: Problem) -> CrossEntropyFn:
    return compiled(cross_entropy_upcast)


def _build_torchgraft(_problem: Problem) -> CrossEntropyFn:
    from torchgraft import functional as tgf

    def torchgraft(logits: Tensor, target: Tensor) -> Tensor:
        return tgf.cross_entropy(logits, target, IGNORE_INDEX)

    return torchgraft


def _build_torchgraft_inplace(_problem: Problem) -> CrossEntropyFn:
    from torchgraft import functional as tgf

    def torchgraft_inplace(logits: Tensor, target: Tensor) -> Tensor:
        # A view (a leaf's memory cannot be written in place): the gradient goes over it.
        return tgf.cross_entropy(
            logits.view_as(logits), target, IGNORE_INDEX, inplace_backward=True
        )

    return torchgraft_inplace


def _build_liger(_problem: Problem) -> CrossEntropyFn:
    loss_class = liger_attr("transformers.cross_entropy", "LigerCrossEntropyLoss")
    loss_fn = loss_class(ignore_index=IGNORE_INDEX)

    def liger(logits: Tensor, target: Tensor) -> Tensor:
        # A view: Liger writes the gradient over its input's memory in the forward.
        return loss_tensor(loss_fn(logits.view_as(logits), target))

    return liger


def routes() -> tuple[Route, ...]:
    """Every cross-entropy route, in table order (the eager baseline first). All run with
    torchgraft's grafts off: the torchgraft route calls its operator directly."""
    stock = functools.partial(stock_dispatch, OP_SYMBOLS)
    return (
        Route(
            "eager",
            "F.cross_entropy on the logits in their dtype (log_softmax + nll_loss)",
            always_available,
            _build_eager,
            stock,
        ),
        Route(
            "eager-upcast",
            "F.cross_entropy(logits.float(), target): transformers' float32 upcast",
            always_available,
            _build_upcast,
            stock,
        ),
        Route(
            "compile",
            "torch.compile of the float32-upcast loss (static shapes)",
            always_available,
            _build_compile,
            stock,
        ),
        Route(
            "torchgraft",
            "torchgraft.functional.cross_entropy: one pass, the gradient kept for the backward",
            torchgraft_unavailable,
            _build_torchgraft,
            stock,
            graft_prefix=TORCHGRAFT_GRAFTS,
        ),
        Route(
            "torchgraft-inplace",
            "the same with inplace_backward=True: the gradient written over the logits",
            torchgraft_unavailable,
            _build_torchgraft_inplace,
            stock,
            graft_prefix=TORCHGRAFT_GRAFTS,
        ),
        Route(
            "liger",
            "Liger-Kernel's LigerCrossEntropyLoss (gradient written over the logits)",
            liger_unavailable,
            _build_liger,
            stock,
        ),
    )
