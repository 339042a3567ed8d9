"""Autograd: forward overrides keep aten's derivative formulas; backward overrides stand alone."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from torchgraft import registry

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]


def dump(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


def _dims(normalized_shape: list[int]) -> list[int]:
    return list(range(-len(normalized_shape), 0))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RmsNormOverrides:
    """Python (float64) impls of aten::_fused_rms_norm and its backward, counting their runs."""

    def __init__(self) -> None:
        self.forward_calls = 0
        self.backward_calls = 0
        self.backward_threads: list[str] = []

    def forward(self, x, normalized_shape, weight, eps):
        self.forward_calls += 1
        dims = _dims(normalized_shape)
        if eps is None:
            eps = torch.finfo(_acc_dtype(x.dtype)).eps
        x64 = x.double()
        rstd = torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + eps)
        y = x64 * rstd
        if weight is not None:
            y = y * weight.double()
        return y.to(x.dtype), rstd.to(_acc_dtype(x.dtype))

    def backward(self, grad_out, x, normalized_shape, rstd, weight, output_mask):
        self.backward_calls += 1
        self.backward_threads.append(threading.current_thread().name)
        dims = _dims(normalized_shape)
        g, x64, r = grad_out.double(), x.double(), rstd.double()
        gw = g * weight.double() if weight is not None else g
        grad_input = r * gw - x64 * r.pow(3) * (gw * x64).mean(dims, keepdim=True)
        grad_weight = None
        if weight is not None and output_mask[1]:
            batch = list(range(x.dim() - len(normalized_shape)))
            grad_weight = (g * x64 * r).sum(batch).to(weight.dtype)
        return (grad_input.to(x.dtype) if output_mask[0] else None), grad_weight

    def register(self, forward: bool = True, backward: bool = True) -> None:
        if forward:
            registry.register_op_override(
                "py",
                "aten",
                "_fused_rms_norm",
                "CPU",
                None,
                self.forward,
                unconditional_override=True,
            )
        if backward:
            registry.register_op_override(
                "py",
                "aten",
                "_fused_rms_norm_backward",
                "CPU",
                None,
                self.backward,
                unconditional_override=True,
            )


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_mm_forward_override_keeps_the_derivative_formula():
    a = torch.randn(6, 5, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    g = torch.randn(6, 4)
    (a.double() @ b.double()).backward(g.double())  # reference grads in float64
    ref_a, ref_b = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    calls = []

    def impl(x, y):
        calls.append((tuple(x.shape), tuple(y.shape)))
        return ref_mm(x, y).to(x.dtype)

    registry.register_op_override(
        "py", "aten", "mm", "CPU", lambda x, y: x.dtype == torch.float32, impl
    )
    out = torch.mm(a, b)
    assert out.grad_fn.name() == "MmBackward0"  # aten's formula, above the router
    out.backward(g)
    assert rel_err(a.grad, ref_a) < 1e-6 and rel_err(b.grad, ref_b) < 1e-6
    # Forward, then the formula's own mm calls (grad @ b.T, a.T @ grad) went through the router.
    assert calls[0] == ((6, 5), (5, 4))
    assert sorted(calls[1:]) == [((5, 6), (6, 4)), ((6, 4), (4, 5))]


def test_mm_override_gradcheck_float64():
    registry.register_op_override(
        "py", "aten", "mm", "CPU", None, lambda x, y: ref_mm(x, y), unconditional_override=True
    )
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(torch.mm, (a, b))
    assert registry.override_stats()["py/aten::mm/CPU"]["calls"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_forward_and_backward_overrides_match_stock(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 3, 16, dtype=dtype)
    w = torch.randn(16, dtype=dtype)
    g = torch.randn(6, 3, 16, dtype=dtype)
    eps = 1e-5
    tol = 1e-12 if dtype == torch.float64 else 1e-6

    x_ref = x.double().clone().requires_grad_()
    w_ref = w.double().clone().requires_grad_()
    rms_norm_ref(x_ref, w_ref, eps).backward(g.double())

    overrides = RmsNormOverrides()
    overrides.register()
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = F.rms_norm(xs, [16], ws, eps)  # F.rms_norm reaches aten::_fused_rms_norm
    assert y.grad_fn.name() == "FusedRmsNormBackward0"
    y.backward(g)
    assert overrides.forward_calls == 1 and overrides.backward_calls == 1
    assert rel_err(y, rms_norm_ref(x, w, eps)) < tol
    assert rel_err(xs.grad, x_ref.grad) < tol
    assert rel_err(ws.grad, w_ref.grad) < tol


def test_rms_norm_override_gradcheck_float64():
    overrides = RmsNormOverrides()
    overrides.register()
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        return torch.ops.aten._fused_rms_norm(x, [7], w, 1e-6)[0]

    assert torch.autograd.gradcheck(fn, (x, w))
    assert overrides.forward_calls > 0 and overrides.backward_calls > 0


def test_backward_runs_the_override_on_the_thread_autograd_uses():
    overrides = RmsNormOverrides()
    overrides.register()
    results = {}

    def train_step():
        x = torch.randn(4, 8, requires_grad=True)
        torch.ops.aten._fused_rms_norm(x, [8], None, 1e-6)[0].sum().backward()
        results["grad"] = x.grad

    worker = threading.Thread(target=train_step, name="trainer")
    worker.start()
    worker.join(30)
    assert results["grad"] is not None and math.isfinite(float(results["grad"].sum()))
    assert overrides.backward_calls == 1 and overrides.backward_threads == ["trainer"]


def test_backward_override_is_independent_of_the_forward():
    forward_table = dump("aten::_fused_rms_norm")
    overrides = RmsNormOverrides()
    overrides.register(forward=False, backward=True)
    # The forward op is untouched: still ATen's composite, on CPU and for autograd.
    assert dump("aten::_fused_rms_norm") == forward_table
    x = torch.randn(5, 6, dtype=torch.float64)
    w = torch.randn(6, dtype=torch.float64)
    g = torch.randn(5, 6, dtype=torch.float64)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [6], w, 1e-6)
    assert overrides.forward_calls == 0
    grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(g, x, [6], rstd, w, [True, True])
    assert overrides.backward_calls == 1
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_ref(x_ref, w_ref, 1e-6).backward(g)
    assert rel_err(grad_x, x_ref.grad) < 1e-12 and rel_err(grad_w, w_ref.grad) < 1e-12

    # With both registered, switching the forward off leaves the backward override live.
    overrides.register(forward=True, backward=False)
    registry.deregister_op_overrides(disable_op_symbols="_fused_rms_norm")
    assert dump("aten::_fused_rms_norm") == forward_table
    assert [(i.op_symbol, i.active) for i in registry.list_overrides()] == [
        ("_fused_rms_norm_backward", True),
        ("_fused_rms_norm", False),
    ]


@pytest.mark.cuda
def test_cuda_forward_override_keeps_atens_cuda_backward():
    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    g = torch.randn(64, 256, device="cuda")
    x_ref = x.double().clone().requires_grad_()
    w_ref = w.double().clone().requires_grad_()
    rms_norm_ref(x_ref, w_ref, 1e-6).backward(g.double())
    overrides = RmsNormOverrides()
    registry.register_op_override(
        "py",
        "aten",
        "_fused_rms_norm",
        "CUDA",
        None,
        overrides.forward,
        unconditional_override=True,
    )
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = F.rms_norm(xs, [256], ws, 1e-6)
    y.backward(g)
    assert overrides.forward_calls == 1 and overrides.backward_calls == 0  # aten's CUDA backward
    assert rel_err(y, rms_norm_ref(x, w, 1e-6)) < 1e-6
    assert rel_err(xs.grad, x_ref.grad) < 1e-5 and rel_err(ws.grad, w_ref.grad) < 1e-5
