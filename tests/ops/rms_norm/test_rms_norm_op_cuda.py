"""torchgraft.functional.rms_norm on the GPU (CUDA C++ launched from Rust): every kernel shape
(rows kernels of each width, the loop kernel, the scalar path), the model variants' numerics
against float64 and against the model's own expression, gradients, layouts, empty inputs,
determinism and counters. Runs on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from torchgraft import functional as tgf
from torchgraft import native, reset_stats, stats
from torchgraft.ops.rms_norm.reference import (
    result_dtype,
    rms_norm_eager,
    rms_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
EPS = 1e-6
MODES = [(0.0, True), (0.0, False), (1.0, False), (1.0, True)]
MODE_IDS = ["llama", "fp32-weight", "gemma", "offset+cast"]


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    if not any(
        k.op == "torchgraft::rms_norm" and k.dispatch_key == "CUDA" and k.active
        for k in native.op_kernels()
    ):
        pytest.skip(f"no CUDA kernels for torchgraft::rms_norm: {native.build_info()}")


def _x(shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64) * 2 + 0.3).to(
        dtype
    )


def _w(cols, dtype, offset, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(cols, generator=gen, device="cuda", dtype=torch.float64) * 0.3 + 1 - offset
    return w.to(dtype)


def _dx_err(dx, dx64, dy, x64, scale):
    # dx cancels where rows are short: its error is measured against its terms' size.
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    terms = float((dy.double() * scale * rstd).norm())
    return float((dx.double() - dx64).norm()) / max(float(dx64.norm()), terms)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
# Every kernel shape: sub-warp row groups (1, 7, 64), each rows V (100..16384: vector and,
# at odd widths, scalar units), and the loop kernel beyond the rows kernels' reach (70001).
@pytest.mark.parametrize("hidden", [1, 7, 64, 100, 1000, 2048, 3000, 4096, 5120, 16384, 70001])
@pytest.mark.parametrize(("offset", "cast"), MODES, ids=MODE_IDS)
def test_against_float64_and_the_cpu_op(dtype, hidden, offset, cast):
    rows = 3 if hidden > 20000 else 37
    for wdtype in (dtype, torch.float32):
        x = _x((rows, hidden), dtype).requires_grad_(True)
        w = _w(hidden, wdtype, offset).requires_grad_(True)
        reset_stats()
        y = tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)
        out = result_dtype(dtype, wdtype, cast)
        assert y.dtype == out
        dy = _x((rows, hidden), out, seed=2)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        x64 = x.detach().double().requires_grad_(True)
        w64 = w.detach().double().requires_grad_(True)
        y64 = rms_norm_reference(x64, w64, EPS, offset, cast)
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
        tol = TOL[dtype]
        assert (y.double() - y64).norm() / y64.norm() < 2 * tol
        assert _dx_err(dx, dx64, dy, x64.detach(), w64.detach() + offset) < 4 * tol
        assert dw.dtype == wdtype
        assert (dw.double() - dw64).norm() / dw64.norm() < 4 * max(tol, TOL[wdtype])
        if out == dtype:  # one kernel each way (else a normalization and a multiply)
            assert stats()["native/torchgraft::rms_norm/CUDA"]["calls"] == 1
            assert stats()["native/torchgraft::rms_norm_backward/CUDA"]["calls"] == 1
        # The CPU op computes the same formula: the same values but for the sum order.
        xc, wc = x.detach().cpu(), w.detach().cpu()
        yc = tgf.rms_norm(xc, wc, EPS, offset=offset, cast_before_weight=cast)
        assert (y.cpu().double() - yc.double()).norm() / yc.double().norm() < 2 * tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("offset", "cast"), MODES[:3], ids=MODE_IDS[:3])
@pytest.mark.parametrize("hidden", [2048, 4096, 5120])
def test_the_model_expression_to_one_unit_in_the_last_place(dtype, offset, cast, hidden):
    x = _x((256, hidden), dtype)
    for wdtype in (dtype, torch.float32):
        w = _w(hidden, wdtype, offset)
        out = tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)
        ref = rms_norm_eager(x, w, EPS, offset, cast)
        assert out.dtype == ref.dtype
        # One unit in the last place of the result. Rounding to x's dtype before the weight
        # (llama) can also move by one unit of x's dtype when rstd differs in its last bit (a
        # different sum order): measured up to 1.4 units (float16) on an H100.
        scale = ref.float().abs().clamp_min(torch.finfo(out.dtype).tiny)
        tol = torch.finfo(out.dtype).eps + (torch.finfo(dtype).eps if cast else 0.0)
        assert ((out.float() - ref.float()).abs() <= tol * scale).all()
        assert (out == ref).float().mean() > 0.98


@pytest.mark.parametrize("shape", [(0, 4096), (5, 0)])
def test_empty_inputs(shape):
    x = _x(shape, torch.bfloat16).requires_grad_(True)
    w = _w(shape[-1], torch.bfloat16, 0.0).requires_grad_(True)
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert y.shape == x.shape and dx.shape == x.shape and dw.shape == w.shape
    assert (dw == 0).all()


def test_non_contiguous_and_unaligned_inputs():
    base = _x((64, 4097), torch.bfloat16)
    x = base[:, 1:]  # 4096 columns whose rows start 2 bytes past alignment
    w = _w(8192, torch.bfloat16, 0.0)[::2]
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    ref = rms_norm_reference(x, w, EPS)
    assert (y.double() - ref).norm() / ref.norm() < 2 * TOL[torch.bfloat16]


def test_weight_gradient_is_deterministic():
    x = _x((8192, 2048), torch.bfloat16)
    w = _w(2048, torch.bfloat16, 0.0).requires_grad_(True)
    dy = _x((8192, 2048), torch.bfloat16, seed=3)
    grads = [
        torch.autograd.grad(tgf.rms_norm(x, w, EPS, cast_before_weight=True), w, dy)[0]
        for _ in range(3)
    ]
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


def test_gradcheck_float64():
    x = _x((3, 33), torch.float64).requires_grad_(True)
    w = _w(33, torch.float64, 1.0).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, w: tgf.rms_norm(x, w, EPS, offset=1.0, cast_before_weight=True), (x, w)
    )


def test_compiles_fullgraph():
    def f(x, w):
        return tgf.rms_norm(x, w, EPS, cast_before_weight=True).float().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = _x((16, 256), torch.bfloat16).requires_grad_(True)
    w = _w(256, torch.bfloat16, 0.0).requires_grad_(True)
    out = compiled(x, w)
    ref = f(x, w)
    assert torch.equal(out, ref)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            torch.autograd.grad(out, (x, w)), torch.autograd.grad(ref, (x, w)), strict=True
        )
    )


def test_device_mismatch_is_an_error():
    x, w = _x((4, 8), torch.float32), _w(8, torch.float32, 0.0).cpu()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        tgf.rms_norm(x, w, EPS)
