"""Fake functions of ``torchgraft::swiglu``, ``torchgraft::geglu``, ``torchgraft::swiglu_packed``
and their backward ops.

The schemas and kernels are native (crates/graft-native/src/ops/glu/); importing this module
defines them and registers the fake functions (shapes for ``torch.compile``, with the kernels'
checks). Their autograd is :mod:`.autograd`'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import Operands
from torchgraft.ops.define import define_ops
from torchgraft.ops.glu.reference import check_halving

__all__: list[str] = []

define_ops()


def _check(
    op: str, gate: Tensor, up: Tensor, grad: Tensor | None = None, written: bool = False
) -> None:
    """The operands of the native kernels (``ops/glu.rs``'s ``check``, ``check_in_place`` when
    ``written``), for fake tensors."""
    (
        Operands(op)
        .tensor("gate", gate, written=written)
        .float()
        .tensor("up", up, written=written)
        .like("gate")
        .optional("grad", grad)
        .like("gate")
        .check()
    )


def _empty(like: Tensor) -> Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


@torch.library.register_fake("torchgraft::swiglu")
def _swiglu_fake(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    _check("swiglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::swiglu_backward")
def _swiglu_backward_fake(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    _check("swiglu_backward", gate, up, grad)
    return _empty(gate), _empty(up)


@torch.library.register_fake("torchgraft::geglu")
def _geglu_fake(gate: Tensor, up: Tensor, tanh: bool, *, inplace_backward: bool = False) -> Tensor:
    _check("geglu", gate, up)
    return _empty(gate)


@torch.library.register_fake("torchgraft::geglu_backward")
def _geglu_backward_fake(
    grad: Tensor, gate: Tensor, up: Tensor, tanh: bool
) -> tuple[Tensor, Tensor]:
    _check("geglu_backward", gate, up, grad)
    return _empty(gate), _empty(up)


@torch.library.register_fake("torchgraft::swiglu_backward_")
def _swiglu_backward_inplace_fake(grad: Tensor, gate: Tensor, up: Tensor) -> None:
    _check("swiglu_backward_", gate, up, grad, written=True)


@torch.library.register_fake("torchgraft::geglu_backward_")
def _geglu_backward_inplace_fake(grad: Tensor, gate: Tensor, up: Tensor, tanh: bool) -> None:
    _check("geglu_backward_", gate, up, grad, written=True)


def _check_packed_backward(op: str, grad: Tensor, gate_up: Tensor, written: bool) -> None:
    """The packed backward's operands (``ops/glu/mod.rs``'s ``check_packed_backward``)."""
    (
        Operands(op)
        .tensor("gate_up", gate_up, written=written)
        .float()
        .tensor("grad", grad)
        .dtype_like("gate_up")
        .check()
    )
    check_halving(op, gate_up)
    Operands(op).tensor("grad", grad).sizes([*gate_up.shape[:-1], gate_up.shape[-1] // 2]).check()


@torch.library.register_fake("torchgraft::swiglu_packed")
def _swiglu_packed_fake(gate_up: Tensor) -> Tensor:
    Operands("swiglu_packed").tensor("gate_up", gate_up).float().check()
    check_halving("swiglu_packed", gate_up)
    half = [*gate_up.shape[:-1], gate_up.shape[-1] // 2]
    return torch.empty(half, dtype=gate_up.dtype, device=gate_up.device)


@torch.library.register_fake("torchgraft::swiglu_packed_backward")
def _swiglu_packed_backward_fake(grad: Tensor, gate_up: Tensor) -> Tensor:
    _check_packed_backward("swiglu_packed_backward", grad, gate_up, written=False)
    return _empty(gate_up)


@torch.library.register_fake("torchgraft::swiglu_packed_backward_")
def _swiglu_packed_backward_inplace_fake(grad: Tensor, gate_up: Tensor) -> None:
    _check_packed_backward("swiglu_packed_backward_", grad, gate_up, written=True)
