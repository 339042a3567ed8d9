"""Fake functions of ``torchgraft::cross_entropy`` and its companions, and their shared checks.

The schemas and kernels are native (crates/graft-native/src/ops/cross_entropy/):

- ``cross_entropy(logits, target, ignore_index, reduction, label_smoothing, compute_grad)
  -> (loss, grad)``: the loss and, in the same pass, its gradient into a new buffer (``grad`` is
  empty without ``compute_grad``);
- ``cross_entropy_(logits!, ...) -> loss``: the gradient written over the logits;
- ``scale_grad(grad, grad_output) -> Tensor`` and ``scale_grad_(grad!, grad_output)``: the
  backward, a saved gradient times the upstream gradient (a scalar, or one factor per row); in
  place, elements whose factor is exactly 1 are not touched (no work for ``loss.backward()``).

``cross_entropy``'s autograd (its backward is ``scale_grad``), and :class:`CrossEntropyInPlace`
for the in-place variant, are :mod:`.autograd`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.define import define_ops

__all__ = [
    "acc_dtype",
    "check_logits",
    "check_reduction",
    "eager",
    "with_target",
]

define_ops()


def eager(*tensors: Tensor) -> bool:
    """Whether this runs eagerly on plain tensors: the condition for working in place on saved
    buffers (traced graphs, torch.compile's and opcheck's, and tensor subclasses get the
    functional ops instead)."""
    return not torch.compiler.is_compiling() and all(type(t) is Tensor for t in tensors)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss's dtype for logits of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def with_target(operands: Operands, target: Tensor, rows: Any) -> Operands:
    """``operands`` and a ``(rows,)`` int64 target, as the native kernels declare it
    (``ops/cross_entropy.rs``'s ``with_target``)."""
    return (
        operands.tensor("target", target)
        .dtype(torch.int64)
        .message("expected target dtype to be Long or Byte, but got {got}")
        .dims(1)
        .message("{op}: expected a 1-D target, got {got} dimensions")
        .size(0, rows)
        .message("Expected input batch_size ({want}) to match target batch_size ({got}).")
    )


def check_logits(op: str, logits: Tensor, target: Tensor, in_place: bool = False) -> None:
    """The native kernels' logits and target checks (``check_logits``), for fake tensors."""
    operands = Operands(op).tensor("logits", logits, written=in_place)
    if in_place:
        operands.contiguous().message(
            "{op}: the logits must be contiguous to take the gradient in place"
        )
    operands.float().dims(2).message("{op}: expected 2-D logits (N, V), got {got} dimensions")
    rows = logits.shape[0] if logits.dim() == 2 else 0
    with_target(operands, target, rows).check()


def check_reduction(op: str, reduction: int) -> None:
    """The native kernels' reduction check (``Reduction::from_i64``), for fake tensors."""
    if reduction not in (0, 1, 2):
        raise RuntimeError(
            f"{op}: {reduction} is not a valid value for reduction (0: none, 1: mean, 2: sum)"
        )


def _check_options(op: str, reduction: int, label_smoothing: float) -> None:
    if label_smoothing > 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    check_reduction(op, reduction)


def _loss_like(logits: Tensor, reduction: int) -> Tensor:
    shape = (logits.shape[0],) if reduction == 0 else ()
    return logits.new_empty(shape, dtype=acc_dtype(logits.dtype))


@torch.library.register_fake("torchgraft::cross_entropy")
def _cross_entropy_fake(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    label_smoothing: float,
    compute_grad: bool,
) -> tuple[Tensor, Tensor]:
    _check_options("cross_entropy", reduction, label_smoothing)
    check_logits("cross_entropy", logits, target)
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    return _loss_like(logits, reduction), grad


@torch.library.register_fake("torchgraft::cross_entropy_")
def _cross_entropy_inplace_fake(
    logits: Tensor, target: Tensor, ignore_index: int, reduction: int, label_smoothing: float
) -> Tensor:
    _check_options("cross_entropy_", reduction, label_smoothing)
    check_logits("cross_entropy_", logits, target, in_place=True)
    return _loss_like(logits, reduction)


def _check_scale(op: str, grad: Tensor, grad_output: Tensor, in_place: bool = False) -> None:
    operands = Operands(op).tensor("grad", grad, written=in_place)
    if in_place:
        operands.contiguous().message("{op}: the gradient must be contiguous")
    operands.float().tensor("grad_output", grad_output).float().check()
    per_row = grad_output.dim() == 1 and grad.dim() > 0 and grad_output.shape[0] == grad.shape[0]
    if grad_output.dim() != 0 and not per_row:
        raise RuntimeError(
            f"{op}: grad_output of size {list(grad_output.shape)} does not fit a gradient of "
            f"size {list(grad.shape)} (a scalar, or one value per row)"
        )


@torch.library.register_fake("torchgraft::scale_grad")
def _scale_grad_fake(grad: Tensor, grad_output: Tensor) -> Tensor:
    _check_scale("scale_grad", grad, grad_output)
    return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


@torch.library.register_fake("torchgraft::scale_grad_")
def _scale_grad_inplace_fake(grad: Tensor, grad_output: Tensor) -> None:
    _check_scale("scale_grad_", grad, grad_output, in_place=True)
