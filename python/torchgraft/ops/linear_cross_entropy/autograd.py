"""Autograd of ``torchgraft::linear_cross_entropy``: the gradients computed in the forward,
scaled by the upstream gradient (``scale_grad_``: no work when it is 1). Importing this module
defines the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.ops.cross_entropy.fake import eager
from torchgraft.ops.linear_cross_entropy import fake  # noqa: F401  (defines the ops and their fake functions)

__all__: list[str] = []


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    hidden, weight, target, bias, ignore_index, reduction, chunk_size, mask = inputs
    ctx.mask = list(mask)
    ctx.unreduced = reduction == 0
    # The gradient outputs are never differentiated: without this, autograd would hand the
    # backward zero-filled tensors of their sizes (d_weight's: V x H) for them.
    ctx.set_materialize_grads(False)
    ctx.consumed = False
    ctx.mark_non_differentiable(*output[1:])
    if ctx.unreduced:
        ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size
        ctx.save_for_backward(hidden, weight, target, bias)
    else:
        ctx.save_for_backward(*output[1:])


def _scaled(ctx: Any, grads: tuple[Tensor, ...], grad_loss: Tensor) -> list[Tensor]:
    if not eager(*grads, grad_loss):
        return [torch.ops.torchgraft.scale_grad(g, grad_loss) for g in grads]
    if ctx.consumed:
        raise RuntimeError(
            "torchgraft linear_cross_entropy: its gradients, computed in the forward, were "
            "consumed by a first backward; backward through the graph a second time "
            "(retain_graph=True) is not supported"
        )
    ctx.consumed = True
    for g in grads:
        torch.ops.torchgraft.scale_grad_(g, grad_loss)
    return list(grads)


def _backward(ctx: Any, grad_loss: Tensor | None, *_unused: Tensor | None) -> tuple[Any, ...]:
    if grad_loss is None:  # an undefined upstream gradient: no gradient flows
        return None, None, None, None, None, None, None, None
    if ctx.unreduced:
        hidden, weight, target, bias = ctx.saved_tensors
        grads = torch.ops.torchgraft.linear_cross_entropy_backward(
            grad_loss, hidden, weight, target, bias, ctx.ignore_index, ctx.chunk_size, ctx.mask
        )
        grads = list(grads)
    else:
        grads = _scaled(ctx, ctx.saved_tensors, grad_loss)
    wanted = zip(grads, ctx.mask, strict=True)
    d_hidden, d_weight, d_bias = (g if want else None for g, want in wanted)
    return d_hidden, d_weight, None, d_bias, None, None, None, None


torch.library.register_autograd("torchgraft::linear_cross_entropy", _backward, setup_context=_setup)
