"""Every native aten graft on drawn operands, against stock PyTorch (the same call with
torchgraft disabled): mixed devices (cpu / meta), dtypes (float32, float64, bfloat16, float16,
int64, bool, complex64), empty, non-contiguous, sliced, expanded (stride 0) and overlapping
(written) operands.

A grafted call raises the exception type stock raises (or RuntimeError, the only type the stable
ABI can raise: docs/reliability.md), or gives stock's values computed in float64 within the
tolerance of the dtypes involved, with stock's shapes; written operands that share memory raise
ATen's RuntimeError (stock computes an undefined result). A call with a meta operand reaches
ATen's meta kernels, not the grafts, in both runs. See ``operand_draws`` for the draws.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgraft
from operand_draws import Draw, Outcome, base_seed, describe, judge, plans, run, upcast

pytestmark = pytest.mark.default_torch

DRAWS = int(os.environ.get("TORCHGRAFT_PROPERTY_DRAWS", "48"))
PLANS = plans()
ATEN = torch.ops.aten


@dataclass(frozen=True)
class Graft:
    """One grafted op: how to draw a call's arguments and make the call. Stock is not run on
    CPU draws that are ``stock_unsafe``: its kernel reads or writes out of bounds there (sizes
    it does not check, a written tensor whose elements share memory), or reads a misfitting
    operand with another's geometry; the graft must raise instead."""

    name: str
    draw: Callable[[Draw], tuple[Any, ...]]
    call: Callable[..., Any]
    stock_unsafe: Callable[[tuple[Any, ...], set[str]], bool] = lambda args, tags: False
    upcast: Callable[[tuple[Any, ...]], tuple[Any, ...]] = upcast


# ---------------------------------------------------------------------------- RMSNorm


def _draw_rms_norm(d: Draw) -> tuple[Any, ...]:
    shape = d.shape((1, 3))
    dims = d.rng.randint(1, len(shape))
    normalized = shape[-dims:]
    x = d.tensor(shape, d.dtype_of())
    weight = None
    if d.chance(0.7):
        weight = d.tensor(d.perturb_shape(normalized), d.dtype_of(perturb=0.15))
    grad = d.tensor(shape, x.dtype if x.dtype.is_floating_point else torch.float32)
    return x, d.perturb_shape(normalized), weight, d.pick([None, 1e-5]), grad, d.chance(0.7)


def _f_rms_norm(x, normalized, weight, eps, grad, train):
    """``F.rms_norm`` and, when training, its gradients (the forward and backward grafts)."""
    if not train or not (x.dtype.is_floating_point or x.dtype.is_complex):
        return F.rms_norm(x, normalized, weight, eps)
    leaves = [x.detach().requires_grad_()]
    if weight is not None and (weight.dtype.is_floating_point or weight.dtype.is_complex):
        leaves.append(weight.detach().requires_grad_())
    w = leaves[1] if len(leaves) > 1 else weight
    y = F.rms_norm(leaves[0], normalized, w, eps)
    return (y, *torch.autograd.grad(y, leaves, grad.to(y.dtype)))


def _fused_rms_norm(x, normalized, weight, eps, grad, train):
    return ATEN._fused_rms_norm(x, normalized, weight, eps)


# ---------------------------------------------------------------------------- softmax


def _draw_dim(d: Draw, ndim: int) -> int:
    n = max(ndim, 1)
    if d.chance(0.06):
        d.mistake("shape")
        return d.pick([n, -n - 1])
    return d.rng.randint(-n, n - 1)


def _draw_softmax(d: Draw) -> tuple[Any, ...]:
    shape = d.shape((0, 3))
    x = d.tensor(shape, d.dtype_of())
    return x, _draw_dim(d, len(shape)), d.chance(0.05)


def _draw_softmax_backward(d: Draw) -> tuple[Any, ...]:
    shape = d.shape((0, 3))
    grad = d.tensor(shape, d.dtype_of())
    output = d.tensor(d.perturb_shape(shape), d.dtype_of(grad.dtype))
    return grad, output, _draw_dim(d, len(shape)), d.dtype_of(grad.dtype)


# ------------------------------------------------------------------------- LayerNorm


def _draw_layer_norm(d: Draw) -> tuple[Any, ...]:
    shape = d.shape((1, 3))
    normalized = shape[-d.rng.randint(1, len(shape)) :]
    x = d.tensor(shape, d.dtype_of())
    params = [
        d.tensor(d.perturb_shape(normalized), d.dtype_of(perturb=0.15)) if d.chance(0.7) else None
        for _ in range(2)
    ]
    return x, d.perturb_shape(normalized), *params, 1e-5


def _draw_layer_norm_backward(d: Draw) -> tuple[Any, ...]:
    x, normalized, weight, bias, eps = _draw_layer_norm(d)
    # The statistics as the forward gives them (stock's, on the draw's device).
    try:
        _, mean, rstd = ATEN.native_layer_norm(x, normalized, weight, bias, eps)
    except Exception:
        rows = list(x.shape[: x.dim() - len(normalized)]) + [1] * len(normalized)
        mean = d.tensor(rows, torch.float32)
        rstd = d.tensor(rows, torch.float32, kind="positive")
    grad = d.tensor(d.perturb_shape(list(x.shape)), d.dtype_of(x.dtype))
    mask = [d.chance(0.8), d.chance(0.6), d.chance(0.6)]
    return grad, x, normalized, mean, rstd, weight, bias, mask


# ------------------------------------------------------------------------------- Adam


def _draw_adam(d: Draw) -> tuple[Any, ...]:
    amsgrad = d.chance(0.4)
    params, grads, avgs, sqs, maxes, steps = [], [], [], [], [], []
    for _ in range(d.rng.randint(1, 3)):
        shape = d.shape((0, 2))
        dtype = d.dtype_of()
        if d.chance(0.08) and shape and all(s > 0 for s in shape):
            # The gradient is the parameter itself (both written).
            param = d.tensor(shape, dtype, layouts=("contiguous",))
            grad = param
            d.tags.add("overlap")
        else:
            param = d.tensor(shape, dtype, written=True)
            grad_shape = shape
            if d.chance(0.06) and param.numel() > 0:
                grad_shape = [shape[0] + 1, *shape[1:]] if shape else [2]  # more elements
                d.mistake("shape")
            grad = d.tensor(grad_shape, d.dtype_of(dtype), written=True)
        params.append(param)
        grads.append(grad)
        avgs.append(d.tensor(shape, dtype, written=True))
        sqs.append(d.tensor(shape, dtype, kind="positive", written=True))
        if amsgrad:
            maxes.append(d.tensor(shape, dtype, kind="positive", written=True))
        steps.append(d.place(torch.tensor(float(d.rng.randint(1, 100)))))
    lr = d.place(torch.tensor(0.01)) if d.chance(0.3) else 0.01
    scale = d.place(torch.tensor(2.0)) if d.chance(0.2) else None
    lists = (params, grads, avgs, sqs, maxes, steps)
    return (*lists, lr, amsgrad, d.chance(0.5), scale)


def _adam_upcast(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The optimizer state in float64; steps, lr and grad scale stay float32 (ATen reads them
    as floats)."""
    return (*upcast(args[:5]), *args[5:])


def _adam(op: Callable[..., None]) -> Callable[..., Any]:
    def call(params, grads, avgs, sqs, maxes, steps, lr, amsgrad, maximize, scale):
        op(
            params,
            grads,
            avgs,
            sqs,
            maxes,
            steps,
            lr=lr,
            beta1=0.9,
            beta2=0.99,
            weight_decay=0.01,
            eps=1e-8,
            amsgrad=amsgrad,
            maximize=maximize,
            grad_scale=scale,
        )
        return params, avgs, sqs, maxes

    return call


def ADAM_UNSAFE(args: tuple[Any, ...], tags: set[str]) -> bool:
    """ATen's fused Adam reads and writes every tensor as a flat array of the parameter's
    length, written ones too."""
    return bool(tags & {"shape", "shape+", "overlap"})


def _has_rows(x: Tensor, normalized: list[int]) -> bool:
    """Whether a LayerNorm backward over ``normalized`` has rows (ATen's kernel then runs)."""
    batch = x.shape[: max(x.dim() - len(normalized), 0)]
    rows = 1
    for s in batch:
        rows *= s
    return rows > 0


GRAFTS = [
    Graft("F.rms_norm (_fused_rms_norm and its backward)", _draw_rms_norm, _f_rms_norm),
    Graft("_fused_rms_norm", _draw_rms_norm, _fused_rms_norm),
    Graft("_softmax", _draw_softmax, ATEN._softmax),
    Graft("_log_softmax", _draw_softmax, ATEN._log_softmax),
    Graft("_softmax_backward_data", _draw_softmax_backward, ATEN._softmax_backward_data),
    Graft(
        "_log_softmax_backward_data",
        _draw_softmax_backward,
        ATEN._log_softmax_backward_data,
        # ATen reads output with grad's sizes (and divides by zero when grad is empty: SIGFPE).
        stock_unsafe=lambda a, tags: a[0].shape != a[1].shape,
    ),
    Graft("native_layer_norm", _draw_layer_norm, ATEN.native_layer_norm),
    Graft(
        "native_layer_norm_backward",
        _draw_layer_norm_backward,
        ATEN.native_layer_norm_backward,
        # ATen reads grad_out with input's sizes.
        stock_unsafe=lambda a, tags: _has_rows(a[1], a[2]) and a[0].shape != a[1].shape,
    ),
    Graft("_fused_adam_", _draw_adam, _adam(ATEN._fused_adam_), ADAM_UNSAFE, _adam_upcast),
    Graft("_fused_adamw_", _draw_adam, _adam(ATEN._fused_adamw_), ADAM_UNSAFE, _adam_upcast),
]


def test_every_native_cpu_graft_has_a_case():
    from torchgraft import native

    grafted = {g.op.removeprefix("aten::").split(".")[0] for g in native.grafts()}
    grafted = {op for op in grafted if op}
    named = {g.name for g in GRAFTS} | {"_fused_rms_norm_backward"}
    assert grafted <= named, grafted - named


def _draw(graft: Graft, seed: int, plan: str) -> tuple[tuple[Any, ...], set[str]]:
    d = Draw(seed, plan)
    args = graft.draw(d)
    tags = set(d.tags)
    if len(d.devices) > 1:
        tags.add("mixed")
    if d.devices == {"meta"}:
        tags.add("meta")
    return args, tags


@pytest.mark.parametrize("graft", GRAFTS, ids=lambda g: g.name)
def test_grafts_raise_what_stock_raises_or_compute_what_it_computes(graft: Graft):
    seed0 = base_seed()
    failures = []
    torchgraft.disable()
    try:
        for i in range(DRAWS):
            seed, plan = seed0 + i, PLANS[i % len(PLANS)]
            ref_args, tags = _draw(graft, seed, plan)
            if graft.stock_unsafe(ref_args, tags) and "meta" not in tags and "mixed" not in tags:
                ref = Outcome(error=RuntimeError("stock reads or writes out of bounds"))
            else:
                ref = run(lambda: graft.call(*ref_args))  # noqa: B023

            def exact() -> Any:
                args = graft.upcast(_draw(graft, seed, plan)[0])  # noqa: B023
                outcome = run(lambda: graft.call(*args))
                return outcome.result if outcome.error is None else ref.result  # noqa: B023

            args, _ = _draw(graft, seed, plan)
            torchgraft.enable()
            try:
                ours = run(lambda: graft.call(*args))  # noqa: B023
            finally:
                torchgraft.disable()
            why = judge(ours, ref, exact, tags, args, native=True)
            if why is not None:
                failures.append(f"seed {seed} ({plan}, {sorted(tags)}, {describe(args)}): {why}")
    finally:
        torchgraft.disable()
    assert not failures, f"{len(failures)} of {DRAWS} draws:\n" + "\n".join(failures[:8])


@pytest.mark.parametrize("weight_dtype", [None, torch.complex64, torch.float32])
def test_complex_f_rms_norm_with_grad_gives_stocks_results_and_gradients(weight_dtype):
    # Issue 30 reported it failing while enabled; on torch 2.15 F.rms_norm sends complex inputs
    # to ATen's composite (not to _fused_rms_norm), which the grafts leave alone.
    x = torch.randn(3, 2, 8, dtype=torch.complex64)
    w = None if weight_dtype is None else torch.randn(8, dtype=weight_dtype)
    grad = torch.randn(3, 2, 8, dtype=torch.complex64)
    stock = _f_rms_norm(x, [8], w, None, grad, True)
    with torchgraft.enabled():
        ours = _f_rms_norm(x, [8], w, None, grad, True)
    for o, s in zip(ours, stock, strict=True):
        torch.testing.assert_close(o, s)
