"""Every ``torch.ops.torchgraft`` op and every ``torchgraft.functional`` face, on drawn operands:
mixed devices (cpu / meta), dtypes (float32, float64, bfloat16, float16, int64, bool, complex64),
empty, non-contiguous, sliced, expanded (stride 0) and overlapping (in-place ops) operands.

Each call is judged against the eager expression it stands for (``ops/<op>/reference.py``; for a
backward op, autograd of that expression; for an in-place op, the functional result copied in):

- a face (``torchgraft.functional``) raises the exception type the eager expression raises, or
  gives its values (computed in float64) within the tolerance of the result's dtype;
- an op raises the same type or RuntimeError (the only type the stable ABI can raise,
  docs/reliability.md), gives the same values, or raises RuntimeError for a draw its contract
  does not take (another dtype, a size that would broadcast, a layout an in-place op does not
  write): never garbage, never an unwritten element (fresh allocations are filled with NaN);
- any call with operands on two devices raises RuntimeError; written operands that share memory
  raise ATen's RuntimeError;
- the op on meta tensors (its fake function) raises what it raises on the CPU (its Rust entry),
  with the same message, or gives outputs of the same sizes, strides and dtypes.

``TORCHGRAFT_PROPERTY_SEED`` repeats a run; ``TORCHGRAFT_PROPERTY_DRAWS`` sets the draws per op.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from operand_draws import (
    CONTRACT_TAGS,
    Draw,
    Outcome,
    base_seed,
    describe,
    judge,
    plans,
    run,
    tensors_of,
    upcast,
)
from torchgraft import functional as tgf
from torchgraft.ops.cross_entropy.reference import cross_entropy_eager
from torchgraft.ops.glu.reference import geglu_eager, swiglu_eager, swiglu_packed_eager
from torchgraft.ops.linear_cross_entropy.reference import linear_cross_entropy_eager
from torchgraft.ops.moe_permute.reference import (
    moe_permute_reference,
    moe_sort_reference,
    moe_unpermute_reference,
)
from torchgraft.ops.rms_norm.reference import acc_dtype, rms_norm_eager
from torchgraft.ops.rope.reference import rope_eager
from torchgraft.ops.topk_sigmoid.reference import topk_sigmoid_reference
from torchgraft.ops.topk_softmax.reference import topk_softmax_reference

pytestmark = pytest.mark.default_torch

DRAWS = int(os.environ.get("TORCHGRAFT_PROPERTY_DRAWS", "48"))
PLANS = plans()
OPS = torch.ops.torchgraft
REDUCTIONS = ["none", "mean", "sum"]
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    """An op (``native``) or a face: how to draw its arguments, call it, and call its eager
    expression."""

    name: str
    draw: Callable[[Draw], tuple[Any, ...]]
    ours: Callable[..., Any]
    eager: Callable[..., Any]
    native: bool = True
    refuses: frozenset[str] = field(default=CONTRACT_TAGS)


def _grads(out: Any, inputs: list[Tensor | None], grad_out: Any, empty_like: Tensor) -> tuple:
    """Gradients of ``out`` (weighted by ``grad_out``) for the inputs given (an empty tensor of
    ``empty_like``'s dtype for each None, as the ops return a gradient not asked for)."""
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
    return tuple(next(got) if t is not None else empty_like.new_empty(0) for t in inputs)


def _leaf(t: Tensor | None, want: bool) -> Tensor | None:
    """``t`` as a leaf requiring grad when ``want`` (None otherwise)."""
    return t.detach().requires_grad_() if want and t is not None else None


# ---------------------------------------------------------------------------------- GLU


def _draw_glu(d: Draw) -> tuple[Tensor, Tensor]:
    shape = d.shape((0, 3))
    gate = d.tensor(shape, d.dtype_of())
    return gate, d.tensor(d.perturb_shape(shape), d.dtype_of())


def _draw_glu_backward(d: Draw) -> tuple[Tensor, Tensor, Tensor]:
    gate, up = _draw_glu(d)
    return d.tensor(d.perturb_shape(list(gate.shape)), d.dtype_of()), gate, up


def _draw_glu_backward_(d: Draw) -> tuple[Tensor, Tensor, Tensor]:
    """Written gate and up: now and then views of one buffer (sharing memory), or a grad that
    is part of gate's memory."""
    shape = d.shape((1, 3))
    n = 1
    for s in shape:
        n *= s
    if d.chance(0.15) and n > 0:
        offset = d.pick([0, 1, n // 2]) if n > 1 else 0
        buf = d.place(d.values([n + offset + 1], d.dtype))
        gate, up = buf[:n].view(shape), buf[offset : offset + n].view(shape)
        d.tags.add("overlap")
        return d.tensor(shape), gate, up
    if d.chance(0.1) and n > 1:
        buf = d.place(d.values([n + 1], d.dtype))
        gate, grad = buf[:n].view(shape), buf[1 : n + 1].view(shape)
        d.tags.add("overlap")
        return grad, gate, d.tensor(shape, written=True)
    gate = d.tensor(shape, d.dtype_of(), written=True)
    up = d.tensor(d.perturb_shape(shape), d.dtype_of(), written=True)
    return d.tensor(shape, d.dtype_of()), gate, up


def _glu_backward_eager(act: Callable[[Tensor], Tensor]) -> Callable[..., tuple]:
    def backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple:
        g, u = _leaf(gate, True), _leaf(up, True)
        return torch.autograd.grad(act(g) * u, (g, u), grad)

    return backward


def _in_place(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """The in-place op's eager form: the functional gradients copied into gate and up."""

    def in_place(grad: Tensor, gate: Tensor, up: Tensor, *extra: Any) -> tuple:
        dgate, dup = backward(grad, gate, up, *extra)
        gate.copy_(dgate)
        up.copy_(dup)
        return gate, up

    return in_place


def _ours_in_place(op: Callable[..., None]) -> Callable[..., tuple]:
    def call(grad: Tensor, gate: Tensor, up: Tensor, *extra: Any) -> tuple:
        op(grad, gate, up, *extra)
        return gate, up

    return call


def _gelu(tanh: bool) -> Callable[[Tensor], Tensor]:
    return lambda g: F.gelu(g, approximate="tanh" if tanh else "none")


def _geglu_bw(grad: Tensor, gate: Tensor, up: Tensor, tanh: bool) -> tuple:
    return _glu_backward_eager(_gelu(tanh))(grad, gate, up)


def _draw_gate_up_shape(d: Draw) -> list[int]:
    """``(..., 2 I)``; now and then an odd last dimension (or none: a scalar), which the ops and
    the eager expression refuse alike."""
    shape = [*d.shape((0, 2)), 2 * d.size()]
    if d.chance(0.06):
        shape[-1] += 1
    if d.chance(0.03):
        shape = []
    return shape


def _draw_swiglu_packed(d: Draw) -> tuple[Tensor]:
    return (d.tensor(_draw_gate_up_shape(d), d.dtype_of()),)


def _draw_swiglu_packed_backward(d: Draw) -> tuple[Tensor, Tensor]:
    shape = _draw_gate_up_shape(d)
    gate_up = d.tensor(shape, d.dtype_of())
    half = [*shape[:-1], shape[-1] // 2] if shape else []
    return d.tensor(d.perturb_shape(half), d.dtype_of()), gate_up


def _draw_swiglu_packed_backward_(d: Draw) -> tuple[Tensor, Tensor]:
    """A written gate_up: now and then a grad that is part of its memory (its gate half, or a
    dense block overlapping it)."""
    shape = [*d.shape((1, 2)), 2 * d.size()]
    half = [*shape[:-1], shape[-1] // 2]
    n = 1
    for s in shape:
        n *= s
    if d.chance(0.15) and n > 0:
        buf = d.place(d.values([n + 1], d.dtype))
        gate_up = buf[:n].view(shape)
        if d.chance(0.5):
            grad = gate_up[..., : shape[-1] // 2]  # gate_up's own gate half
            if grad.is_contiguous():
                # One row: a dense block inside gate_up, which ATen's overlap rule refuses (with
                # more rows it is strided, and the op reads it through a copy).
                d.tags.add("overlap")
        else:
            grad = buf[n // 2 : n].view(half)  # a dense block overlapping gate_up's second half
            d.tags.add("overlap")
        return grad, gate_up
    gate_up = d.tensor(shape, d.dtype_of(), written=True)
    return d.tensor(d.perturb_shape(half), d.dtype_of()), gate_up


def _swiglu_packed_backward_eager(grad: Tensor, gate_up: Tensor) -> tuple:
    leaf = _leaf(gate_up, True)
    return torch.autograd.grad(swiglu_packed_eager(leaf), leaf, grad)


def _swiglu_packed_in_place_eager(grad: Tensor, gate_up: Tensor) -> Tensor:
    (d_gate_up,) = _swiglu_packed_backward_eager(grad, gate_up)
    return gate_up.copy_(d_gate_up)


def _swiglu_packed_in_place_ours(grad: Tensor, gate_up: Tensor) -> Tensor:
    OPS.swiglu_packed_backward_(grad, gate_up)
    return gate_up


GLU = [
    Case("swiglu", _draw_glu, OPS.swiglu, swiglu_eager),
    Case(
        "geglu",
        lambda d: (*_draw_glu(d), d.chance(0.5)),
        OPS.geglu,
        lambda g, u, t: geglu_eager(g, u, "tanh" if t else "none"),
    ),
    Case("swiglu_backward", _draw_glu_backward, OPS.swiglu_backward, _glu_backward_eager(F.silu)),
    Case(
        "geglu_backward",
        lambda d: (*_draw_glu_backward(d), d.chance(0.5)),
        OPS.geglu_backward,
        _geglu_bw,
    ),
    Case(
        "swiglu_backward_",
        _draw_glu_backward_,
        _ours_in_place(OPS.swiglu_backward_),
        _in_place(_glu_backward_eager(F.silu)),
    ),
    Case(
        "geglu_backward_",
        lambda d: (*_draw_glu_backward_(d), d.chance(0.5)),
        _ours_in_place(OPS.geglu_backward_),
        _in_place(_geglu_bw),
    ),
    Case("swiglu_packed", _draw_swiglu_packed, OPS.swiglu_packed, swiglu_packed_eager),
    Case(
        "swiglu_packed_backward",
        _draw_swiglu_packed_backward,
        OPS.swiglu_packed_backward,
        _swiglu_packed_backward_eager,
    ),
    Case(
        "swiglu_packed_backward_",
        _draw_swiglu_packed_backward_,
        _swiglu_packed_in_place_ours,
        _swiglu_packed_in_place_eager,
    ),
    Case(
        "functional.swiglu", _draw_glu, tgf.swiglu, swiglu_eager, native=False, refuses=frozenset()
    ),
    Case(
        "functional.swiglu_packed",
        _draw_swiglu_packed,
        tgf.swiglu_packed,
        swiglu_packed_eager,
        native=False,
        refuses=frozenset(),
    ),
    Case(
        "functional.geglu",
        lambda d: (*_draw_glu(d), d.pick(["none", "tanh"])),
        tgf.geglu,
        geglu_eager,
        native=False,
        refuses=frozenset(),
    ),
]


# --------------------------------------------------------------------------------- RoPE


def _draw_rope(d: Draw) -> tuple[Any, ...]:
    b, s, hq, hk = d.size(), d.size(), d.size(), d.size()
    dim = d.pick([2, 4, 6, 8])
    rotary = d.pick([r for r in (2, 4, dim) if r <= dim])
    heads_first = d.chance(0.5)
    shape = (
        ([b, hq, s, dim], [b, hk, s, dim]) if heads_first else ([b, s, hq, dim], [b, s, hk, dim])
    )
    at = 1 if heads_first else 2
    if d.chance(0.2):
        at -= 4  # the same place, counted from the end
    if d.chance(0.06):
        at = d.pick([5, -6])
        d.mistake("shape")
    table = [d.pick([b, 1]), s, rotary]
    q, k = d.tensor(shape[0], d.dtype_of()), d.tensor(shape[1], d.dtype_of())
    cos = d.tensor(table, d.dtype_of())
    sin = d.tensor(d.perturb_shape(table), d.dtype_of())
    return q, k, cos, sin, at


def _rope_backward_eager(gq: Tensor, gk: Tensor, cos: Tensor, sin: Tensor, at: int) -> tuple:
    q = torch.zeros_like(gq).requires_grad_()
    k = torch.zeros_like(gk).requires_grad_()
    return torch.autograd.grad(rope_eager(q, k, cos, sin, at), (q, k), (gq, gk))


ROPE = [
    Case("rope", _draw_rope, OPS.rope, rope_eager),
    Case("rope_backward", _draw_rope, OPS.rope_backward, _rope_backward_eager),
    Case("functional.rope", _draw_rope, tgf.rope, rope_eager, native=False, refuses=frozenset()),
]


# ---------------------------------------------------------------------- cross-entropy


def _draw_ce_rows(d: Draw, *, written: bool = False) -> tuple[Tensor, Tensor]:
    rows, classes = d.size(0, 5), d.size(0, 6)
    shape = [rows, classes]
    if written:
        # The in-place op writes its gradient over contiguous logits only.
        logits = d.tensor(shape, d.dtype_of(), layouts=("contiguous", "transposed", "sliced"))
        if not logits.is_contiguous():
            d.mistake("layout")
    else:
        logits = d.tensor(shape, d.dtype_of())
    if d.chance(0.06):
        logits = logits.unsqueeze(0)
        d.mistake("shape")
    return logits, d.target(d.perturb_shape([rows]), classes)


def _draw_ce(d: Draw) -> tuple[Any, ...]:
    logits, target = _draw_ce_rows(d)
    return logits, target, -100, d.pick([0, 1, 2]), d.pick([0.0, 0.0, 0.1]), d.chance(0.6)


def _ce_eager(logits: Tensor, target: Tensor, ignore: int, red: int, smoothing: float, grad: bool):
    x = logits.detach().requires_grad_(grad)
    loss = F.cross_entropy(
        x, target, ignore_index=ignore, reduction=REDUCTIONS[red], label_smoothing=smoothing
    )
    if not grad:
        return loss, logits.new_empty(0)
    (g,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    return loss, g


def _draw_ce_(d: Draw) -> tuple[Any, ...]:
    logits, target = _draw_ce_rows(d, written=True)
    return logits, target, -100, d.pick([0, 1, 2]), d.pick([0.0, 0.1])


def _ce_inplace_eager(logits: Tensor, target: Tensor, ignore: int, red: int, smoothing: float):
    loss, grad = _ce_eager(logits, target, ignore, red, smoothing, True)
    logits.copy_(grad)
    return loss, logits


def _ce_inplace_ours(logits: Tensor, target: Tensor, ignore: int, red: int, smoothing: float):
    return OPS.cross_entropy_(logits, target, ignore, red, smoothing), logits


def _draw_scale(d: Draw, *, written: bool = False) -> tuple[Tensor, Tensor]:
    shape = d.shape((1, 3))
    if written and d.chance(0.12) and shape[0] > 0:
        # The factors are part of the gradient's memory.
        n = 1
        for s in shape:
            n *= s
        buf = d.place(d.values([n + 1], d.dtype))
        if n > 1:
            d.tags.add("overlap")
        return buf[:n].view(shape), buf[1 : shape[0] + 1]
    layouts = (
        ("contiguous", "transposed", "sliced")
        if written
        else ("contiguous", "transposed", "sliced", "expanded")
    )
    grad = d.tensor(shape, d.dtype_of(), layouts=layouts)
    if written and not grad.is_contiguous():
        d.mistake("layout")
    out_shape = d.pick([[], [shape[0]]])
    return grad, d.tensor(d.perturb_shape(out_shape), d.dtype_of(torch.float32))


def _scale_eager(grad: Tensor, grad_output: Tensor) -> Tensor:
    if grad_output.dim() == 0:
        return grad * grad_output
    return grad * grad_output.reshape(-1, *[1] * (grad.dim() - 1))


def _scale_inplace_ours(grad: Tensor, grad_output: Tensor) -> Tensor:
    OPS.scale_grad_(grad, grad_output)
    return grad


def _scale_inplace_eager(grad: Tensor, grad_output: Tensor) -> Tensor:
    factors = (
        grad_output if grad_output.dim() == 0 else grad_output.reshape(-1, *[1] * (grad.dim() - 1))
    )
    return grad.mul_(factors)


def _draw_ce_face(d: Draw) -> tuple[Any, ...]:
    lead = d.shape((0, 2))
    classes = d.size(0, 6)
    logits = d.tensor([*lead, classes], d.dtype_of())
    target = d.target(d.perturb_shape(lead), classes)
    return logits, target, -100, d.pick(REDUCTIONS), d.pick([0.0, 0.0, 0.1])


CROSS_ENTROPY = [
    Case("cross_entropy", _draw_ce, OPS.cross_entropy, _ce_eager),
    Case("cross_entropy_", _draw_ce_, _ce_inplace_ours, _ce_inplace_eager),
    Case("scale_grad", _draw_scale, OPS.scale_grad, _scale_eager),
    Case(
        "scale_grad_",
        lambda d: _draw_scale(d, written=True),
        _scale_inplace_ours,
        _scale_inplace_eager,
    ),
    Case(
        "functional.cross_entropy",
        _draw_ce_face,
        tgf.cross_entropy,
        cross_entropy_eager,
        native=False,
        refuses=frozenset(),
    ),
]


# ----------------------------------------------------------------- linear cross-entropy


def _draw_lce_operands(d: Draw, lead: list[int]) -> tuple[Any, ...]:
    hidden_size, classes = d.size(0, 5), d.size(0, 6)
    hidden = d.tensor([*lead, hidden_size], d.dtype_of())
    weight = d.tensor(d.perturb_shape([classes, hidden_size]), d.dtype_of())
    bias = d.tensor(d.perturb_shape([classes]), d.dtype_of()) if d.chance(0.4) else None
    return hidden, weight, d.target(d.perturb_shape(lead), classes), bias


def _draw_lce(d: Draw) -> tuple[Any, ...]:
    hidden, weight, target, bias = _draw_lce_operands(d, [d.size(0, 5)])
    mask = [d.chance(0.6), d.chance(0.6), d.chance(0.6)]
    return hidden, weight, target, bias, -100, d.pick([0, 1, 2]), d.pick([0, 1, 2, 3]), mask


def _lce_eager(hidden, weight, target, bias, ignore, red, chunk, mask):
    want = [m and red != 0 for m in mask]
    leaves = [_leaf(hidden, want[0]), _leaf(weight, want[1]), _leaf(bias, want[2])]
    h, w, b = (
        leaf if leaf is not None else t
        for leaf, t in zip(leaves, (hidden, weight, bias), strict=True)
    )
    loss = F.cross_entropy(
        F.linear(h, w, b), target, ignore_index=ignore, reduction=REDUCTIONS[red]
    )
    return (loss, *_grads(loss, leaves, torch.ones_like(loss), hidden))


def _draw_lce_backward(d: Draw) -> tuple[Any, ...]:
    hidden, weight, target, bias = _draw_lce_operands(d, [d.size(0, 5)])
    rows = hidden.shape[0] if hidden.dim() else 0
    grad_output = d.tensor(d.perturb_shape([rows]), d.dtype_of(torch.float32))
    mask = [d.chance(0.7), d.chance(0.7), d.chance(0.7)]
    return grad_output, hidden, weight, target, bias, -100, d.pick([0, 1, 2]), mask


def _lce_backward_eager(grad_output, hidden, weight, target, bias, ignore, chunk, mask):
    leaves = [_leaf(hidden, mask[0]), _leaf(weight, mask[1]), _leaf(bias, mask[2])]
    h, w, b = (
        leaf if leaf is not None else t
        for leaf, t in zip(leaves, (hidden, weight, bias), strict=True)
    )
    loss = F.cross_entropy(F.linear(h, w, b), target, ignore_index=ignore, reduction="none")
    return _grads(loss, leaves, grad_output, hidden)


def _draw_lce_face(d: Draw) -> tuple[Any, ...]:
    hidden, weight, target, bias = _draw_lce_operands(d, d.shape((0, 2)))
    return hidden, weight, target, bias, -100, d.pick(REDUCTIONS), d.pick([None, 1, 2, 3])


def _lce_face(hidden, weight, target, bias, ignore, reduction, chunk):
    return tgf.linear_cross_entropy(
        hidden, weight, target, bias, ignore, reduction, chunk_size=chunk
    )


LINEAR_CROSS_ENTROPY = [
    Case("linear_cross_entropy", _draw_lce, OPS.linear_cross_entropy, _lce_eager),
    Case(
        "linear_cross_entropy_backward",
        _draw_lce_backward,
        OPS.linear_cross_entropy_backward,
        _lce_backward_eager,
    ),
    Case(
        "functional.linear_cross_entropy",
        _draw_lce_face,
        _lce_face,
        lambda h, w, t, b, i, r, _c: linear_cross_entropy_eager(h, w, t, b, i, r),
        native=False,
        refuses=frozenset(),
    ),
]


# ---------------------------------------------------------------------------- RMSNorm


def _draw_rms_norm_operands(d: Draw) -> tuple[Tensor, Tensor | None, float, bool]:
    shape = d.shape((0, 3))
    if not shape:
        d.mistake("shape")  # the op normalizes the last dimension
    x = d.tensor(shape, d.dtype_of())
    weight = None
    if d.chance(0.7):
        weight = d.tensor(d.perturb_shape(shape[-1:]), d.dtype_of(perturb=0.15))
        if weight.dtype != x.dtype:
            d.mistake("dtype")
    offset = d.pick([0.0, 1.0]) if weight is not None else 0.0
    return x, weight, offset, d.chance(0.5)


def _draw_rms_norm(d: Draw) -> tuple[Any, ...]:
    x, weight, offset, cast = _draw_rms_norm_operands(d)
    return x, weight, EPS, offset, cast


def _rms_norm_op_eager(x, weight, eps, offset, cast):
    h = x.to(acc_dtype(x.dtype))
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
    return rms_norm_eager(x, weight, eps, offset, cast), rstd


def _draw_rms_norm_backward(d: Draw) -> tuple[Any, ...]:
    x, weight, offset, cast = _draw_rms_norm_operands(d)
    grad = d.tensor(d.perturb_shape(list(x.shape)), d.dtype_of(x.dtype))
    rows = list(x.shape[:-1])
    if x.dtype.is_floating_point:
        rstd = torch.rsqrt(x.to(acc_dtype(x.dtype)).pow(2).mean(-1) + EPS)
    else:
        rstd = d.tensor(rows, torch.float32, kind="positive")
    wrong = d.perturb_shape(rows, p=0.08)
    if wrong != rows:
        rstd = d.tensor(wrong, torch.float32, kind="positive")
    return grad, x, rstd, weight, offset, cast, [d.chance(0.7), d.chance(0.7)]


def _rms_norm_backward_eager(grad, x, rstd, weight, offset, cast, mask):
    leaves = [_leaf(x, mask[0]), _leaf(weight, mask[1])]
    xx, ww = (leaf if leaf is not None else t for leaf, t in zip(leaves, (x, weight), strict=True))
    y = rms_norm_eager(xx, ww, EPS, offset, cast)
    dx, dw = _grads(y, leaves, grad, x)
    if weight is not None and leaves[1] is None:
        dw = weight.new_empty(0)
    return dx, dw


def _rms_norm_face(x, weight, eps, offset, cast):
    return tgf.rms_norm(x, weight, eps, offset=offset, cast_before_weight=cast)


RMS_NORM = [
    Case("rms_norm", _draw_rms_norm, OPS.rms_norm, _rms_norm_op_eager),
    Case(
        "rms_norm_backward",
        _draw_rms_norm_backward,
        OPS.rms_norm_backward,
        _rms_norm_backward_eager,
    ),
    Case(
        "functional.rms_norm",
        _draw_rms_norm,
        _rms_norm_face,
        rms_norm_eager,
        native=False,
        refuses=frozenset(),
    ),
]

# ---------------------------------------------------------------------- MoE routing


def _draw_topk(d: Draw) -> tuple[Any, ...]:
    rows, experts = d.size(), d.size(lo=1, hi=9, empty=0.0)
    shape = [rows, experts]
    if d.chance(0.08):
        shape = d.pick([[experts], [rows, 2, experts]])
        d.mistake("shape")  # the op takes (tokens, experts); torch's ops take any
    k = d.pick([1, 2, experts]) if experts > 1 else 1
    if d.chance(0.06):
        k = d.pick([0, experts + 1])  # k = 0: torch returns nothing, the op refuses
        if k == 0:
            d.mistake("shape")
    return d.tensor(shape, d.dtype_of()), k, d.chance(0.5)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _draw_topk_backward(d: Draw) -> tuple[Any, ...]:
    rows, experts = d.size(), d.size(lo=1, hi=9, empty=0.0)
    values = d.values([rows, experts], d.dtype_of())  # on the CPU: the routing is read from it
    logits = d.place(values)
    k = d.pick([1, 2, experts]) if experts > 1 else 1
    renormalize = d.chance(0.5)
    with torch.no_grad():
        real = values.real if values.is_complex() else values
        probs = torch.softmax(real.to(torch.float64), dim=-1)
        weights, indices = torch.topk(probs, k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    acc = _acc(logits.dtype) if logits.is_floating_point() else torch.float32
    weights = d.place(weights.to(d.dtype_of(acc)))
    indices = d.place(indices)
    grad = d.tensor(d.perturb_shape([rows, k]), d.dtype_of(acc))
    return grad, logits, weights, indices, renormalize


def _topk_backward_eager(
    grad: Tensor, logits: Tensor, weights: Tensor, indices: Tensor, renormalize: bool
) -> tuple:
    leaf = logits.detach().requires_grad_()
    w = torch.softmax(leaf, dim=-1, dtype=_acc(logits.dtype)).gather(-1, indices)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if weights.dtype != w.dtype or weights.shape != w.shape:
        raise RuntimeError("weights do not match the logits' routing")
    return torch.autograd.grad(w, leaf, grad)


def _draw_topk_sigmoid(d: Draw) -> tuple[Any, ...]:
    rows = d.size()
    groups, size = d.pick([1, 2, 3]), d.pick([2, 3])
    experts = groups * size
    shape = [rows, experts]
    if d.chance(0.08):
        shape = d.pick([[experts], [rows, 2, experts]])
        d.mistake("shape")  # the op takes (tokens, experts); torch's ops take any
    topk_groups = d.pick(range(1, groups + 1))
    k = d.pick(range(1, topk_groups * size + 1))
    if d.chance(0.06):
        # Beyond the kept groups: torch's ops choose among the left-out experts, the op refuses.
        k = topk_groups * size + 1
        d.mistake("shape")
    # Not expanded: torch's float64 sigmoid gives equal logits values an ulp apart (its vector
    # and tail loops), so the reference would break their ties its own way.
    logits = d.tensor(shape, d.dtype_of(), layouts=("contiguous", "transposed", "sliced"))
    bias = None
    if d.chance(0.6):
        dtype = _acc(logits.dtype) if logits.is_floating_point() else torch.float32
        if d.chance(0.1):
            # Floating only: an integer bias with equal logits makes group scores that tie in
            # real numbers and not in float32, where the float64 reference breaks them otherwise.
            dtype = d.pick([torch.float16, torch.bfloat16, torch.float64, torch.float32])
            d.mistake("dtype")
        bias = d.tensor(d.perturb_shape([experts]), dtype)
    return logits, bias, k, groups, topk_groups, d.chance(0.5), d.pick([1.0, 2.5])


def _draw_topk_sigmoid_backward(d: Draw) -> tuple[Any, ...]:
    rows, experts = d.size(), d.size(lo=2, hi=9, empty=0.0)
    values = d.values([rows, experts], d.dtype_of())
    logits = d.place(values)
    k = d.pick([1, 2, experts])
    with torch.no_grad():
        real = values.real if values.is_complex() else values
        indices = torch.topk(real.to(torch.float64), k, dim=-1).indices
    acc = _acc(logits.dtype) if logits.is_floating_point() else torch.float32
    indices = d.place(indices)
    grad = d.tensor(d.perturb_shape([rows, k]), d.dtype_of(acc))
    return grad, logits, indices, d.chance(0.5), d.pick([1.0, 2.5])


def _topk_sigmoid_backward_eager(
    grad: Tensor, logits: Tensor, indices: Tensor, renormalize: bool, scale: float
) -> tuple:
    leaf = logits.detach().requires_grad_()
    w = leaf.to(_acc(logits.dtype)).sigmoid().gather(-1, indices)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return torch.autograd.grad(w * scale, leaf, grad)


def _topk_sigmoid_face(
    logits: Tensor,
    bias: Tensor | None,
    k: int,
    groups: int,
    topk_groups: int,
    renormalize: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    return tgf.topk_sigmoid(
        logits,
        k,
        bias=bias,
        groups=groups,
        topk_groups=topk_groups,
        renormalize=renormalize,
        scale=scale,
    )


ROUTING = [
    Case("topk_softmax", _draw_topk, OPS.topk_softmax, topk_softmax_reference),
    Case("topk_softmax_backward", _draw_topk_backward, OPS.topk_softmax_backward,
         _topk_backward_eager),
    Case(
        "functional.topk_softmax",
        _draw_topk,
        lambda logits, k, renorm: tgf.topk_softmax(logits, k, renormalize=renorm),
        topk_softmax_reference,
        native=False,
        refuses=frozenset(),
    ),
    Case("topk_sigmoid", _draw_topk_sigmoid, OPS.topk_sigmoid, topk_sigmoid_reference),
    Case("topk_sigmoid_backward", _draw_topk_sigmoid_backward, OPS.topk_sigmoid_backward,
         _topk_sigmoid_backward_eager),
    Case(
        "functional.topk_sigmoid",
        _draw_topk_sigmoid,
        _topk_sigmoid_face,
        topk_sigmoid_reference,
        native=False,
        refuses=frozenset(),
    ),
]  # fmt: skip

# ---------------------------------------------------------------- MoE token permutation


def _draw_moe_indices(d: Draw, pairs: int) -> tuple[Tensor, Tensor, Tensor]:
    """A random permutation of the pairs, its inverse (each now and then a strided view, or
    int32: tagged ``dtype``) and ``valid`` (int32 or int64, now and then out of ``[0, S]``:
    clamped, or float: tagged ``dtype``)."""
    perm = torch.randperm(pairs, generator=d.gen)
    inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(pairs))

    def index(values: Tensor) -> Tensor:
        if d.chance(0.05):
            values = values.int()
            d.mistake("dtype")
        if d.chance(0.2):
            wide = torch.stack([values, torch.zeros_like(values)], dim=-1)
            return d.place(wide)[:, 0]
        return d.place(values)

    count = d.pick([0, pairs, pairs // 2, d.pick([-1, pairs + 3])])
    valid = torch.tensor([count], dtype=d.pick([torch.int32, torch.int64]))
    if d.chance(0.05):
        valid = valid.float()
        d.mistake("dtype")
    return index(perm), index(inv_perm), d.place(valid.reshape(d.pick([[1], []])))


def _draw_moe_sort(d: Draw) -> tuple[Tensor, int]:
    """Expert ids of any shape, some of other ranks (below 0 or from ``num_experts`` on), now
    and then a strided view or int32 (tagged ``dtype``); ``num_experts`` now and then 0."""
    experts = d.pick([1, 2, 5, 8])
    shape = d.shape((0, 3))
    ids = torch.randint(-1, experts + 2, shape, generator=d.gen)
    if d.chance(0.05):
        ids = ids.int()
        d.mistake("dtype")
    if d.chance(0.2) and ids.dim() > 0:
        wide = torch.stack([ids, torch.zeros_like(ids)], dim=-1)
        ids = d.place(wide)[..., 0]
    else:
        ids = d.place(ids)
    if d.chance(0.05):
        experts = 0
    return ids, experts


def _moe_sort_eager(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The op's three outputs (``valid`` is the face's view of the offsets)."""
    return moe_sort_reference(expert_ids, num_experts)[:3]


def _draw_moe_permute(d: Draw) -> tuple[Any, ...]:
    tokens, top_k, width = d.size(), d.pick([1, 2, 3]), d.size()
    perm, _, valid = _draw_moe_indices(d, tokens * top_k)
    if d.chance(0.06):
        top_k = d.pick([top_k + 1, 0])  # the perm no longer has tokens * top_k pairs
        d.mistake("shape")
    return d.tensor([tokens, width], d.dtype_of()), perm, valid, top_k


def _draw_moe_weights(d: Draw, tokens: int, top_k: int) -> Tensor | None:
    if d.chance(0.3):
        return None
    dtype = d.pick([torch.float32, d.dtype])
    return d.tensor(d.perturb_shape([tokens, top_k]), d.dtype_of(dtype), kind="positive")


def _draw_moe_unpermute(d: Draw) -> tuple[Any, ...]:
    tokens, top_k, width = d.size(), d.pick([1, 2, 3]), d.size()
    _, inv_perm, valid = _draw_moe_indices(d, tokens * top_k)
    y = d.tensor([tokens * top_k, width], d.dtype_of())
    weights = _draw_moe_weights(d, tokens, top_k)
    if d.chance(0.06) and tokens * top_k > 1:
        top_k = d.pick([0, tokens * top_k + 1])  # not a divisor of the rows
        d.mistake("shape")
    return y, inv_perm, valid, weights, top_k


def _draw_moe_unpermute_backward(d: Draw) -> tuple[Any, ...]:
    tokens, top_k, width = d.size(), d.pick([1, 2, 3]), d.size()
    perm, inv_perm, valid = _draw_moe_indices(d, tokens * top_k)
    grad = d.tensor(d.perturb_shape([tokens, width]), d.dtype_of())
    y = d.tensor([tokens * top_k, width], d.dtype_of())
    return grad, y, perm, inv_perm, valid, _draw_moe_weights(d, tokens, top_k), top_k


def _moe_unpermute_backward_eager(grad, y, perm, inv_perm, valid, weights, top_k) -> tuple:
    leaves = [_leaf(y, True), _leaf(weights, weights is not None)]
    out = moe_unpermute_reference(leaves[0], inv_perm, valid, leaves[1], top_k)
    return _grads(out, leaves, grad, y)


MOE_PERMUTE = [
    Case("moe_sort", _draw_moe_sort, OPS.moe_sort, _moe_sort_eager),
    Case("functional.moe_sort", _draw_moe_sort, tgf.moe_sort, moe_sort_reference, native=False,
         refuses=frozenset()),
    Case("moe_permute", _draw_moe_permute, OPS.moe_permute, moe_permute_reference),
    Case("moe_unpermute", _draw_moe_unpermute, OPS.moe_unpermute, moe_unpermute_reference),
    Case("moe_unpermute_backward", _draw_moe_unpermute_backward, OPS.moe_unpermute_backward,
         _moe_unpermute_backward_eager),
    Case("functional.moe_permute", _draw_moe_permute, tgf.moe_permute, moe_permute_reference,
         native=False, refuses=frozenset()),
    Case("functional.moe_unpermute", _draw_moe_unpermute, tgf.moe_unpermute,
         moe_unpermute_reference, native=False, refuses=frozenset()),
]  # fmt: skip

CASES = GLU + ROPE + CROSS_ENTROPY + LINEAR_CROSS_ENTROPY + RMS_NORM + ROUTING + MOE_PERMUTE


def test_every_torchgraft_op_has_a_case():
    ops = {name for name in dir(OPS) if not name.startswith("_") and name not in ("name",)}
    ops = {op for op in ops if isinstance(getattr(OPS, op), torch._ops.OpOverloadPacket)}
    covered = {c.name for c in CASES if c.native}
    assert ops - {n for n in ops if n.startswith("rms_norm_triton")} <= covered, ops - covered


# ------------------------------------------------------------------------------ running


def _draw(case: Case, seed: int, plan: str) -> tuple[tuple[Any, ...], set[str]]:
    d = Draw(seed, plan)
    args = case.draw(d)
    tags = set(d.tags)
    if len(d.devices) > 1:
        tags.add("mixed")
    if d.devices == {"meta"}:
        tags.add("meta")
    return args, tags


def _judge_on_meta(
    case: Case, seed: int, ours: Outcome, tags: set[str], args: tuple[Any, ...]
) -> str | None:
    """Meta kernels check less than CPU ones: on meta tensors a call may also do what the eager
    expression does on the CPU (raise its error), except what depends on values (a target out
    of bounds), which meta tensors have none of."""
    cpu_args, _ = _draw(case, seed, "cpu")
    cpu = run(lambda: case.eager(*cpu_args))
    if cpu.error is not None and str(cpu.error).startswith("Target "):
        return None
    why = judge(ours, cpu, None, tags, args, native=case.native, refuses=case.refuses)
    return None if why is None else f"{why} (eager on meta: see above; on the CPU {cpu})"


def _parity(cpu: Outcome, meta: Outcome) -> str | None:
    """Why the op on meta tensors (its fake function) did not do what it did on the CPU."""
    if cpu.error is not None:
        if str(cpu.error).startswith("Target "):
            return None  # a value the CPU reads and meta tensors have none of
        if type(meta.error) is type(cpu.error) and str(meta.error) == str(cpu.error):
            return None
        return f"cpu {cpu}, meta {meta}"
    if meta.error is not None:
        return f"cpu {cpu}, meta {meta}"
    outs, metas = tensors_of(cpu.result), tensors_of(meta.result)
    layouts = [(list(t.shape), t.stride(), t.dtype) for t in outs]
    meta_layouts = [(list(t.shape), t.stride(), t.dtype) for t in metas]
    if any(s == 0 for t in outs for s in t.shape):
        # Strides of empty tensors are not compared (any are valid).
        layouts = [(s, d) for s, _, d in layouts]
        meta_layouts = [(s, d) for s, _, d in meta_layouts]
    if layouts != meta_layouts:
        return f"cpu outputs {layouts}, meta outputs {meta_layouts}"
    return None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ops_raise_what_torch_raises_or_compute_what_it_computes(case: Case):
    seed0 = base_seed()
    failures = []
    for i in range(DRAWS):
        seed, plan = seed0 + i, PLANS[i % len(PLANS)]
        args, tags = _draw(case, seed, plan)
        ours = run(lambda: case.ours(*args))  # noqa: B023
        ref_args, _ = _draw(case, seed, plan)
        ref = run(lambda: case.eager(*ref_args))  # noqa: B023

        def exact() -> Any:
            exact_args = upcast(_draw(case, seed, plan)[0])  # noqa: B023
            outcome = run(lambda: case.eager(*exact_args))
            return outcome.result if outcome.error is None else ref.result  # noqa: B023

        why = judge(ours, ref, exact, tags, args, native=case.native, refuses=case.refuses)
        if why is not None and "meta" in tags:
            why = _judge_on_meta(case, seed, ours, tags, args)
        if why is None and case.native and plan == "cpu" and "overlap" not in tags:
            meta_args, _ = _draw(case, seed, "meta")
            why = _parity(ours, run(lambda: case.ours(*meta_args)))  # noqa: B023
        if why is not None:
            failures.append(f"seed {seed} ({plan}, {sorted(tags)}, {describe(args)}): {why}")
    assert not failures, f"{len(failures)} of {DRAWS} draws:\n" + "\n".join(failures[:8])
