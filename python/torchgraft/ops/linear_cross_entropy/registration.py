"""Serves torch's ``F.linear_cross_entropy`` (torch 2.14+) with torchgraft's fused kernel.

With ``options=LinearCrossEntropyOptions(...)``, ``F.linear_cross_entropy`` calls the custom op
``torch_nn::_linear_cross_entropy_batch_chunked``: loss and gradients computed in the forward,
by chunks of rows, and scaled by the upstream gradient in torch's own backward. That is the
contract of ``torchgraft::linear_cross_entropy`` with its ``output_mask``, so an override at CPU
and CUDA runs the native op (the logits matmuls in aten, the row kernels in Rust / CUDA C++)
where its numerics match what the options ask for, and passes every other call on to torch's
implementation:

- class-index targets (1-D int64), no class weights, no label smoothing, ``mean`` / ``sum``;
- ``input``, ``linear_weight`` and ``linear_bias`` of one floating dtype;
- accumulation in float32 (float64 for float64 input). The weight gradient accumulates in the
  weight's dtype, one rounding per chunk, as ``acc_policy="compact"`` does: low-precision
  input under ``"accurate"`` (torch's default on the CPU for bf16 / fp16) is left to torch.

The op's ``batch_chunk_size`` is honoured: it is the caller's bound on memory.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torchgraft.registry import OverrideInfo

__all__ = [
    "DISPATCH_KEYS",
    "OP_SYMBOL",
    "ROUTES",
    "deregister",
    "notes",
    "op_available",
    "register",
]

log = logging.getLogger("torchgraft.ops.linear_cross_entropy")

OP_SYMBOL = "_linear_cross_entropy_batch_chunked"
DISPATCH_KEYS = ("CPU", "CUDA")
#: The route whose kernels the impl runs (the native op), under which ``enable()`` installs it.
ROUTES = ("native",)

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_registered: list[OverrideInfo] = []


def op_available() -> bool:
    """Whether this torch has the chunked op (2.14+); imports the module that defines it."""
    try:
        import torch.nn.modules.linear_cross_entropy
    except ImportError:
        return False
    return hasattr(torch.ops.torch_nn, OP_SYMBOL)


def cond(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    linear_bias: Tensor | None,
    weight: Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    batch_chunk_size: int,
    acc_policy: str,
    acc_dtype: torch.dtype,
    *_flags: bool,
) -> bool:
    """The calls the native op computes with the numerics the options ask for (module doc)."""
    dtype = input.dtype
    low_precision = dtype in (torch.bfloat16, torch.float16)
    return (
        dtype in _FLOATS
        and input.dim() == 2
        and linear_weight.dim() == 2
        and linear_weight.dtype == dtype
        and (linear_bias is None or linear_bias.dtype == dtype)
        and linear_weight.device == input.device
        and target.device == input.device
        and target.dtype == torch.int64
        and target.dim() == 1
        and weight is None
        and label_smoothing == 0.0
        and reduction in ("mean", "sum")
        and acc_dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        and not (low_precision and acc_policy != "compact")
        and batch_chunk_size >= 1
    )


def impl(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    linear_bias: Tensor | None,
    weight: Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    batch_chunk_size: int,
    acc_policy: str,
    acc_dtype: torch.dtype,
    allow_retain_graph: bool,
    compute_input_grad: bool,
    compute_linear_weight_grad: bool,
    compute_linear_bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, grad_input, grad_linear_weight, grad_linear_bias)`` as torch's op returns them:
    the loss in the input's dtype, each gradient not asked for empty ((0, 0), (0, 0), (0,))."""
    from torch.nn.modules import linear_cross_entropy as torch_lce

    # The op's own checks of the flags against requires_grad, kept by torch for overrides.
    check = getattr(torch_lce, "_check_batch_chunked_grad_flags", None)
    if check is not None:
        check(
            input,
            linear_weight,
            target,
            linear_bias,
            compute_input_grad,
            compute_linear_weight_grad,
            compute_linear_bias_grad,
        )
    from . import autograd  # noqa: F401  (the native op, its fake functions and autograd)

    mask = [compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad]
    red = 1 if reduction == "mean" else 2
    loss, d_input, d_weight, d_bias = torch.ops.torchgraft.linear_cross_entropy(
        input, linear_weight, target, linear_bias, ignore_index, red, batch_chunk_size, mask
    )
    # A fresh empty tensor for each gradient not asked for: a custom op's outputs may not alias.
    return (
        loss.to(input.dtype),
        d_input if compute_input_grad else input.new_empty((0, 0)),
        d_weight if compute_linear_weight_grad else input.new_empty((0, 0)),
        d_bias if compute_linear_bias_grad else input.new_empty((0,)),
    )


def register(route: str = "native") -> None:
    """Installs the override at CPU and CUDA (idempotent). A no-op, logged, on a torch without
    the op (before 2.14) or without the native op."""
    if route not in ROUTES:
        raise ValueError(f"unknown linear_cross_entropy route {route!r}; known: {ROUTES}")
    from torchgraft import native, registry

    live = {o.node_id for o in registry.list_overrides()}
    if [info for info in _registered if info.node_id in live]:
        return
    if not op_available():
        log.info("torch_nn::%s not overridden: this torch does not have it", OP_SYMBOL)
        return
    if not native.available():
        log.info("torch_nn::%s not overridden: torchgraft._native is not built", OP_SYMBOL)
        return
    for key in DISPATCH_KEYS:
        info = registry.register_op_override(route, "torch_nn", OP_SYMBOL, key, cond, impl)
        if info is not None:
            _registered.append(info)


def deregister(route: str | None = None) -> None:
    """Removes exactly the overrides :func:`register` installed; other overrides stay."""
    del route  # one route
    from torchgraft import registry

    while _registered:
        registry.remove_override(_registered.pop())


def notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> the calls the override takes`` (for ``torchgraft list``)."""
    return {
        ("native", OP_SYMBOL): (
            "class-index targets, one float dtype, no class weights, mean/sum, float32 "
            "accumulation (compact)"
        )
    }
