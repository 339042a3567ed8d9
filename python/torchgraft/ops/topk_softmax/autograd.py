"""Autograd of ``torchgraft::topk_softmax``: the gradient reaches the logits through
``torchgraft::topk_softmax_backward`` (the indices get none). Importing this module defines the
ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.topk_softmax import fake  # noqa: F401  (defines the ops and fake functions)

__all__ = ["topk_softmax"]


def _save(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    logits, _, renormalize = inputs
    weights, indices = output
    ctx.save_for_backward(logits, weights, indices)
    ctx.renormalize = renormalize


def _grad(ctx: Any, grad_weights: Tensor, _grad_indices: Tensor | None) -> tuple[Any, ...]:
    logits, weights, indices = ctx.saved_tensors
    if grad_weights is None:
        return None, None, None
    grad = torch.ops.torchgraft.topk_softmax_backward(
        grad_weights.to(weights.dtype), logits, weights, indices, ctx.renormalize
    )
    return grad, None, None


# The op's autograd, and what torchgraft.functional calls.
topk_softmax = register_autograd(torch.ops.torchgraft.topk_softmax.default, _grad, _save)
