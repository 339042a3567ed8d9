"""Autograd of ``torchgraft::cross_entropy`` (its backward is ``scale_grad``), and
:class:`CrossEntropyInPlace` for the in-place variant, which cannot have a registered formula
(autograd formulas need functional schemas): see :func:`torchgraft.functional.cross_entropy` for
when that is safe. Importing this module defines the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.ops.cross_entropy.fake import eager

__all__ = ["CrossEntropyInPlace"]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    loss, grad = output
    # The gradient output is never differentiated: without this, autograd would hand the
    # backward a zero-filled tensor of the logits' size for it (an allocation and a memset).
    ctx.set_materialize_grads(False)
    if inputs[5]:
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(grad)
    else:
        # Called without compute_grad: there is no gradient to give.
        ctx.mark_non_differentiable(loss, grad)


def _is_one(grad_loss: Tensor, grad: Tensor) -> bool:
    """Whether the upstream gradient is known, without waiting for a device, to be exactly 1
    (``loss.backward()`` on the CPU): then the saved gradient is the answer as it is."""
    return (
        grad_loss.device.type == "cpu"
        and grad_loss.dim() == 0
        and eager(grad, grad_loss)
        and grad_loss.item() == 1.0
    )


def _backward(ctx: Any, grad_loss: Tensor | None, _grad_of_grad: Tensor | None) -> tuple[Any, ...]:
    if grad_loss is None:  # an undefined upstream gradient: no gradient flows
        return None, None, None, None, None, None
    (grad,) = ctx.saved_tensors
    # The saved buffer may be handed out: autograd never writes into an incoming gradient
    # (AccumulateGrad takes it only when nothing else holds it, i.e. not with retain_graph).
    scaled = grad if _is_one(grad_loss, grad) else torch.ops.torchgraft.scale_grad(grad, grad_loss)
    return scaled, None, None, None, None, None


torch.library.register_autograd("torchgraft::cross_entropy", _backward, setup_context=_setup)


class CrossEntropyInPlace(torch.autograd.Function):
    """The loss through ``cross_entropy_``: the logits' buffer becomes their gradient.

    The forward overwrites ``logits`` (and bumps its version counter, so that an autograd node
    that saved it fails loudly instead of reading the gradient); the backward scales that buffer
    in place by the upstream gradient (no work when it is 1) and returns it. A second backward
    through the same graph raises: the buffer was consumed.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        ignore_index: int,
        reduction: int,
        label_smoothing: float,
    ) -> Tensor:
        loss = torch.ops.torchgraft.cross_entropy_(
            logits, target, ignore_index, reduction, label_smoothing
        )
        torch.autograd.graph.increment_version(logits)
        ctx.save_for_backward(logits)
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.consumed:
            raise RuntimeError(
                "torchgraft cross_entropy(inplace_backward=True): its gradient, held in the "
                "logits' buffer, was consumed by a first backward; backward through the graph a "
                "second time (retain_graph=True) needs inplace_backward=False"
            )
        (grad,) = ctx.saved_tensors
        ctx.consumed = True
        torch.ops.torchgraft.scale_grad_(grad, grad_loss)
        return grad, None, None, None, None
