"""Autograd of ``torchgraft::moe_permute`` and ``torchgraft::moe_unpermute``. Importing this
module defines the ops and their fake functions (:mod:`.fake`).

- ``moe_permute``'s gradient w.r.t. ``hidden`` is ``moe_unpermute`` of the output's gradient
  without weights (each token sums the gradients of its real slots).
- ``moe_unpermute``'s gradients w.r.t. ``y`` and ``weights`` come from one call of
  ``torchgraft::moe_unpermute_backward``; without weights, ``y``'s is ``moe_permute`` of the
  output's gradient (and ``y`` is not saved).

Each formula needs the permutation the op was not given (``inv_perm`` for ``moe_permute``,
``perm`` for ``moe_unpermute``): one scatter of ``S`` indices in the backward.
``perm``, ``inv_perm`` and ``valid`` get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.moe_permute import fake  # noqa: F401  (defines the ops and fake functions)
from torchgraft.ops.moe_permute.reference import inverse_permutation

__all__ = ["moe_permute", "moe_unpermute"]


def _save_permute(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, perm, valid, top_k = inputs
    ctx.save_for_backward(perm, valid)
    ctx.top_k = top_k


def _grad_permute(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    perm, valid = ctx.saved_tensors
    if grad is None or not ctx.needs_input_grad[0]:
        return None, None, None, None
    inv_perm = inverse_permutation(perm)
    dhidden = torch.ops.torchgraft.moe_unpermute(grad, inv_perm, valid, None, ctx.top_k)
    return dhidden, None, None, None


def _save_unpermute(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    y, inv_perm, valid, weights, top_k = inputs
    # y is read only for the weights' gradient: without weights it is not kept alive.
    ctx.save_for_backward(y if weights is not None else None, inv_perm, valid, weights)
    ctx.top_k, ctx.dtype = top_k, y.dtype


def _grad_unpermute(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    y, inv_perm, valid, weights = ctx.saved_tensors
    if grad is None:
        return None, None, None, None, None
    perm = inverse_permutation(inv_perm)
    if weights is None:
        # dy[s] = grad[perm[s] // top_k] for the real slots: the permutation itself.
        dy = torch.ops.torchgraft.moe_permute(grad.to(ctx.dtype), perm, valid, ctx.top_k)
        return dy, None, None, None, None
    dy, dweights = torch.ops.torchgraft.moe_unpermute_backward(
        grad.to(ctx.dtype), y, perm, inv_perm, valid, weights, ctx.top_k
    )
    wants_y, wants_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    return dy if wants_y else None, None, None, dweights if wants_weights else None, None


# The ops' autograd, and what torchgraft.functional calls.
moe_permute = register_autograd(
    torch.ops.torchgraft.moe_permute.default, _grad_permute, _save_permute
)
moe_unpermute = register_autograd(
    torch.ops.torchgraft.moe_unpermute.default, _grad_unpermute, _save_unpermute
)
