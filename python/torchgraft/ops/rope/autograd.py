"""Autograd of ``torchgraft::rope`` (its backward is ``rope_backward``; the tables' gradients,
when asked for, by the eager formula), and :data:`rope`, what ``torchgraft.functional.rope``
calls. Importing this module defines the ops and their fake functions (:mod:`.fake`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.common.eager_autograd import register_autograd
from torchgraft.ops.rope import fake  # noqa: F401  (defines the ops and their fake functions)
from torchgraft.ops.rope.reference import rotate_half

__all__ = ["rope"]


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin = inputs[:4]
    ctx.unsqueeze_dim = inputs[4] if len(inputs) > 4 else 1
    ctx.table_grads = cos.requires_grad or sin.requires_grad
    if ctx.table_grads:
        ctx.save_for_backward(cos, sin, q, k)
    else:
        ctx.save_for_backward(cos, sin)


def _table_grads(
    q: Tensor, k: Tensor, cos: Tensor, grad_q: Tensor, grad_k: Tensor, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    """Gradients of ``cos`` and ``sin``: the eager formula's, summed over the broadcast dims."""
    table = cos.unsqueeze(unsqueeze_dim)
    rotary = table.shape[-1]
    dcos = torch.zeros_like(table)
    dsin = torch.zeros_like(table)
    for x, g in ((q, grad_q), (k, grad_k)):
        x_rot, g_rot = x[..., :rotary], g[..., :rotary]
        dcos = dcos + (g_rot * x_rot).sum_to_size(table.shape)
        dsin = dsin + (g_rot * rotate_half(x_rot)).sum_to_size(table.shape)
    return dcos.squeeze(unsqueeze_dim), dsin.squeeze(unsqueeze_dim)


def _rope_grad(
    ctx: Any, grad_q: Tensor, grad_k: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, None]:
    cos, sin = ctx.saved_tensors[:2]
    dq, dk = torch.ops.torchgraft.rope_backward(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim)
    dcos = dsin = None
    if ctx.table_grads:
        q, k = ctx.saved_tensors[2:]
        dcos, dsin = _table_grads(q, k, cos, grad_q, grad_k, ctx.unsqueeze_dim)
    return dq, dk, dcos, dsin, None


# The op's autograd, and what torchgraft.functional.rope calls (less host work per call).
rope = register_autograd(torch.ops.torchgraft.rope.default, _rope_grad, _save_inputs)
