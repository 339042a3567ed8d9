"""Autograd of ``torchgraft::topk_sigmoid``: the gradient reaches the logits through
``torchgraft::topk_sigmoid_backward`` (the bias and the indices get none: the bias only steers
the choice). Importing this module defines the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.topk_sigmoid import fake  # noqa: F401  (defines the ops and fake functions)

__all__ = ["topk_sigmoid"]


def _save(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    logits, _, _, _, _, renormalize, scale = inputs
    weights, indices = output
    ctx.save_for_backward(logits, indices)
    ctx.weights_dtype = weights.dtype
    ctx.renormalize, ctx.scale = renormalize, scale


def _grad(ctx: Any, grad_weights: Tensor, _grad_indices: Tensor | None) -> tuple[Any, ...]:
    logits, indices = ctx.saved_tensors
    if grad_weights is None:
        return (None,) * 7
    grad = torch.ops.torchgraft.topk_sigmoid_backward(
        grad_weights.to(ctx.weights_dtype), logits, indices, ctx.renormalize, ctx.scale
    )
    return (grad,) + (None,) * 6


# The op's autograd, and what torchgraft.functional calls.
topk_sigmoid = register_autograd(torch.ops.torchgraft.topk_sigmoid.default, _grad, _save)
