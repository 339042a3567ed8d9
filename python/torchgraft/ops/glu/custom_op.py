"""Autograd and fake functions of ``torchgraft::swiglu`` and ``torchgraft::geglu``.

The schemas and kernels are native (crates/graft-native/src/ops/glu.rs); importing this module
defines them and registers what only Python can give: the fake function (shapes for
``torch.compile``, with the kernels' checks) and the autograd formula, whose backward is the
fused ``*_backward`` op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgraft.ops.native_ops import define_native_ops

__all__: list[str] = []

define_native_ops()


def _check(op: str, gate: Tensor, up: Tensor) -> None:
    """The checks the native kernels make, for fake tensors (same messages)."""
    if not gate.dtype.is_floating_point:
        raise RuntimeError(f"\"{op}\" not implemented for '{gate.dtype}'")
    if up.dtype != gate.dtype:
        raise RuntimeError(f"{op}: expected up to have dtype {gate.dtype}, got {up.dtype}")
    if up.shape != gate.shape:
        raise RuntimeError(f"{op}: expected up of size {list(gate.shape)}, got {list(up.shape)}")


def _empty(like: Tensor) -> Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


@torch.library.register_fake("torchgraft::swiglu")
def _swiglu_fake(gate: Tensor, up: Tensor) -> Tensor:
    _check("swiglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::swiglu_backward")
def _swiglu_backward_fake(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    _check("swiglu_backward", gate, up)
    return _empty(gate), _empty(up)


@torch.library.register_fake("torchgraft::geglu")
def _geglu_fake(gate: Tensor, up: Tensor, tanh: bool) -> Tensor:
    _check("geglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::geglu_backward")
def _geglu_backward_fake(
    grad: Tensor, gate: Tensor, up: Tensor, tanh: bool
) -> tuple[Tensor, Tensor]:
    _check("geglu_backward", gate, up)
    return _empty(gate), _empty(up)


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up = inputs[0], inputs[1]
    ctx.save_for_backward(gate, up)
    ctx.tanh = inputs[2] if len(inputs) > 2 else None


def _swiglu_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    return torch.ops.torchgraft.swiglu_backward(grad, gate, up)


def _geglu_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.torchgraft.geglu_backward(grad, gate, up, ctx.tanh)
    return dgate, dup, None


torch.library.register_autograd("torchgraft::swiglu", _swiglu_grad, setup_context=_save_inputs)
torch.library.register_autograd("torchgraft::geglu", _geglu_grad, setup_context=_save_inputs)
