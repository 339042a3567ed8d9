"""Fake functions of ``torchgraft::linear_cross_entropy`` (autograd: :mod:`.autograd`).

The schemas and the chunked orchestration are native
(crates/graft-native/src/ops/linear_cross_entropy/):

- ``linear_cross_entropy(hidden, weight, target, bias?, ignore_index, reduction, chunk_size,
  output_mask[3]) -> (loss, d_hidden, d_weight, d_bias)``: for ``mean`` / ``sum`` the gradients
  of the loss (those ``output_mask`` asks for; the others are empty) are complete after the
  forward; for ``none`` they are empty;
- ``linear_cross_entropy_backward(grad_output, hidden, weight, target, bias?, ignore_index,
  chunk_size, output_mask[3]) -> (d_hidden, d_weight, d_bias)``: ``none``'s backward, which
  runs the chunks again with the per-row upstream gradient folded into each row.

The backward of ``mean`` / ``sum`` scales the saved gradients by the upstream gradient, in place
(``scale_grad_``: no work when it is 1, the usual ``loss.backward()``), and returns them; a second
backward through the same graph raises. While traced (``torch.compile``, export, any tensor
subclass) it scales out of place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.cross_entropy.fake import acc_dtype, check_reduction, with_target
from torchgraft.ops.define import define_ops

__all__: list[str] = []

define_ops()


def _check(
    op: str,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    grad_output: Tensor | None = None,
) -> None:
    """The native kernels' checks (``Problem::new``), for fake tensors (same messages)."""
    rows = hidden.shape[0] if hidden.dim() > 0 else 0
    vocab = weight.shape[0] if weight.dim() > 0 else 0
    operands = (
        Operands(op)
        .tensor("hidden", hidden)
        .float()
        .dims(2)
        .message("{op}: expected 2-D hidden (N, H), got {got} dimensions")
        .tensor("weight", weight)
        .dtype_like("hidden")
        .dims(2)
        .message("{op}: expected 2-D weight (V, H), got {got} dimensions")
        .optional("bias", bias)
        .dtype_like("hidden")
        .sizes([vocab])
        .optional("grad_output", grad_output)
        .float()
        .sizes([rows])
    )
    with_target(operands, target, rows).check()
    if hidden.shape[1] != weight.shape[1]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({hidden.shape[0]}x{hidden.shape[1]} "
            f"and {weight.shape[1]}x{weight.shape[0]})"
        )


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 0:
        raise RuntimeError(
            f"linear_cross_entropy: chunk_size must be positive (0: automatic), got {chunk_size}"
        )


def _grads_like(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, mask: list[bool], computed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    def grad(want: bool, like: Tensor | None) -> Tensor:
        shape = like.shape if want and computed and like is not None else (0,)
        return hidden.new_empty(shape)

    return grad(mask[0], hidden), grad(mask[1], weight), grad(mask[2], bias)


@torch.library.register_fake("torchgraft::linear_cross_entropy")
def _forward_fake(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    reduction: int,
    chunk_size: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_reduction("linear_cross_entropy", reduction)
    _check("linear_cross_entropy", hidden, weight, target, bias)
    _check_chunk_size(chunk_size)
    shape = (hidden.shape[0],) if reduction == 0 else ()
    loss = hidden.new_empty(shape, dtype=acc_dtype(hidden.dtype))
    return (loss, *_grads_like(hidden, weight, bias, output_mask, reduction != 0))


@torch.library.register_fake("torchgraft::linear_cross_entropy_backward")
def _backward_fake(
    grad_output: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    chunk_size: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    _check("linear_cross_entropy_backward", hidden, weight, target, bias, grad_output)
    _check_chunk_size(chunk_size)
    return _grads_like(hidden, weight, bias, output_mask, True)
