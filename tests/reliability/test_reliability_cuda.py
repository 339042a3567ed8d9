"""Reliability promises of the native CUDA grafts (issue 10); skipped without a GPU."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FWD, BWD = "native/aten::_fused_rms_norm/CUDA", "native/aten::_fused_rms_norm_backward/CUDA"


@pytest.fixture(autouse=True)
def _clean_state():
    if native.cuda_devices() == 0:
        pytest.skip("this build or machine has no native CUDA grafts")
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def reference_grads(x, w, dy):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    return torch.autograd.grad(y, (x64, w64), dy.double())


def test_backward_after_disable_runs_atens_cuda_kernel_on_our_saved_tensors():
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    dy = torch.randn(64, 1024, device="cuda")
    with torchgraft.enabled(routes=["native"]):
        y = F.rms_norm(x, [1024], w, 1e-6)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert torchgraft.stats()[FWD]["calls"] == 1 and torchgraft.stats()[BWD]["calls"] == 0
    rx, rw = reference_grads(x, w, dy)
    assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_weight_gradient_under_a_half_input_is_float32_accurate(dtype):
    x = torch.randn(256, 2048, device="cuda", dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(2048, device="cuda").requires_grad_()
    dy = torch.randn(256, 2048, device="cuda", dtype=torch.float64).to(dtype)
    with torchgraft.enabled(routes=["native"]):
        y, _ = torch.ops.aten._fused_rms_norm(x, [2048], w, 1e-6)
        gw = torch.autograd.grad(y, w, dy)[0]
    assert torchgraft.stats()[BWD]["calls"] == 1
    assert gw.dtype == torch.float32
    assert rel_err(gw, reference_grads(x, w, dy)[1]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layouts_match_the_meta_functions_on_cuda(dtype):
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_reliability_layouts import layout, meta, random_sizes, strided
    finally:
        sys.path.pop(0)
    rng = random.Random(99)
    fwd, bwd = torch.ops.aten._fused_rms_norm.default, torch.ops.aten._fused_rms_norm_backward
    mismatches = []
    with torchgraft.enabled(routes=["native"]):
        for _ in range(150):
            sizes = random_sizes(rng)
            k = rng.randint(1, len(sizes))
            x = strided(sizes, rng, dtype).cuda()
            ns = list(x.shape[len(x.shape) - k :])
            w = strided(ns, rng, dtype).cuda() if rng.random() < 0.6 else None
            y, rstd = fwd(x, ns, w, 1e-5)
            dy = strided(list(x.shape), rng, dtype).cuda()
            dx, _ = bwd.default(dy, x, ns, rstd, w, [True, False])
            mw = None if w is None else meta(w)
            y_m, rstd_m = fwd(meta(x), ns, mw, 1e-5)
            dx_m, _ = bwd.default(meta(dy), meta(x), ns, meta(rstd), mw, [True, False])
            got = (layout(y)[1:], layout(rstd)[1:], layout(dx)[1:])
            want = (layout(y_m)[1:], layout(rstd_m)[1:], layout(dx_m)[1:])
            if got != want:
                mismatches.append((layout(x), got, want))
    assert not mismatches, mismatches[:3]


def test_sanitizer_driver_passes():
    # The script the compute-sanitizer runs use (bench/sanitize_native_cuda.py), run plainly.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import sanitize_native_cuda
    finally:
        sys.path.pop(0)
    assert sanitize_native_cuda.main() == 0
