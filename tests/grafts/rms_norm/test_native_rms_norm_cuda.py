"""The native CUDA RMSNorm graft (CUDA C++ launched from Rust): numerics over a sweep, gradients,
layouts, dtypes and counters. Runs on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.grafts.rms_norm.reference import (
    rms_norm_backward_reference,
    rms_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FWD, BWD = "native/aten::_fused_rms_norm/CUDA", "native/aten::_fused_rms_norm_backward/CUDA"
TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _native_only():
    torchgraft.disable()
    torchgraft.enable(routes=["native"])
    if not any(g.dispatch_key == "CUDA" and g.active for g in native.grafts()):
        pytest.skip(f"no native CUDA grafts: {native.build_info()['cuda_devices']}")
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def calls(key: str) -> int:
    return torchgraft.stats()[key]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def acc_eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "hidden", [64, 100, 127, 512, 1000, 1024, 2048, 3000, 4096, 5120, 8192, 12288, 16384]
)
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
@pytest.mark.parametrize("weight_grad", ["with", "frozen", "none"])
def test_sweep_against_float64_reference(dtype, hidden, rows, weight_grad):
    x, dy = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
    with_weight = weight_grad != "none"
    w = randn(hidden, dtype=dtype) if with_weight else None
    y, rstd = torch.ops.aten._fused_rms_norm(x, [hidden], w, None)
    mask = [True, weight_grad == "with"]
    dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [hidden], rstd, w, mask)
    dx_again, _ = torch.ops.aten._fused_rms_norm_backward(dy, x, [hidden], rstd, w, mask)
    torch.cuda.synchronize()
    assert calls(FWD) == 1 and calls(BWD) == 2
    w64 = None if w is None else w.double()
    y_ref, rstd_ref = rms_norm_reference(x.double(), [hidden], w64, acc_eps(dtype))
    dx_ref, dw_ref = rms_norm_backward_reference(
        dy.double(), x.double(), [hidden], rstd_ref, w64, [True, True]
    )
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(rstd, rstd_ref) < (1e-12 if dtype == torch.float64 else 4e-6)
    assert rel_err(dx, dx_ref) < 4 * TOL[dtype]
    assert torch.equal(dx, dx_again), "dx differs between two identical calls"
    if mask[1]:
        assert dw.dtype == dtype and rel_err(dw, dw_ref) < 4 * TOL[dtype]
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_shapes_multi_dim_and_unaligned(dtype):
    for shape, k in [((2, 3, 4096), 1), ((4, 6, 10), 2), ((3, 4097), 1), ((5, 1), 1)]:
        base = randn(shape[0] * 2 + 1, *shape[1:], dtype=dtype)
        x = base[1 : 1 + shape[0]]  # offset by one row: unaligned for odd widths
        ns = list(shape[-k:])
        w = randn(*ns, dtype=dtype)
        y, _ = torch.ops.aten._fused_rms_norm(x, ns, w, 1e-5)
        y_ref, _ = rms_norm_reference(x.double(), ns, w.double(), 1e-5)
        assert rel_err(y, y_ref) < TOL[dtype], shape


def test_gradcheck_float64():
    x = randn(3, 5, 33, dtype=torch.float64).requires_grad_()
    w = randn(33, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: F.rms_norm(x, [33], w, 1e-3), (x, w))
    assert torch.autograd.gradcheck(lambda x: F.rms_norm(x, [5, 33], None, None), (x,))
    assert calls(FWD) > 0 and calls(BWD) > 0


def test_module_training_step_matches_stock():
    norm = torch.nn.RMSNorm(2048, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = randn(4, 128, 2048, dtype=torch.bfloat16).requires_grad_()
    torchgraft.disable()
    y_stock = norm(x)
    g_stock = torch.autograd.grad(y_stock.float().square().sum(), (x, norm.weight))
    torchgraft.enable(routes=["native"])
    y = norm(x)
    g = torch.autograd.grad(y.float().square().sum(), (x, norm.weight))
    assert calls(FWD) == 1 and calls(BWD) == 1
    assert rel_err(y, y_stock) < 2 * TOL[torch.bfloat16]
    for a, b in zip(g, g_stock, strict=True):
        assert rel_err(a, b) < 4 * TOL[torch.bfloat16]


def test_layouts_match_meta_and_mixed_weight_falls_back_correctly():
    x = randn(8, 6, dtype=torch.float32).t()  # non-contiguous
    y, rstd = torch.ops.aten._fused_rms_norm(x, [8], None, None)
    y_meta, rstd_meta = torch.ops.aten._fused_rms_norm(x.to("meta"), [8], None, None)
    assert y.stride() == y_meta.stride() and rstd.stride() == rstd_meta.stride()
    xb, w32 = randn(4, 256, dtype=torch.bfloat16), randn(256, dtype=torch.float32)
    y, _ = torch.ops.aten._fused_rms_norm(xb, [256], w32, 1e-6)
    y_ref, _ = rms_norm_reference(xb.double(), [256], w32.double(), 1e-6)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_ref) < TOL[torch.bfloat16]
    assert torchgraft.stats()[FWD]["fallbacks"] == 1


def test_empty_inputs_and_other_streams():
    y, rstd = torch.ops.aten._fused_rms_norm(randn(0, 64, dtype=torch.bfloat16), [64], None, None)
    assert y.shape == (0, 64) and rstd.shape == (0, 1)
    _, rstd = torch.ops.aten._fused_rms_norm(randn(3, 0, dtype=torch.float32), [0], None, None)
    assert torch.isnan(rstd).all()
    stream = torch.cuda.Stream()
    x = randn(512, 4096, dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        y, _ = torch.ops.aten._fused_rms_norm(x, [4096], None, None)
    stream.synchronize()
    y_ref, _ = rms_norm_reference(x.double(), [4096], None, acc_eps(torch.bfloat16))
    assert rel_err(y, y_ref) < TOL[torch.bfloat16]


def test_errors_are_runtime_errors():
    x = randn(4, 8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="expected input with shape"):
        torch.ops.aten._fused_rms_norm(x, [5], None, None)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.aten._fused_rms_norm(x, [8], torch.randn(8), None)
    with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
        torch.ops.aten._fused_rms_norm(x.long(), [8], None, None)


def test_dw_is_deterministic():
    x, dy = randn(8192, 4096, dtype=torch.bfloat16), randn(8192, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [4096], w, None)
    runs = [torch.ops.aten._fused_rms_norm_backward(dy, x, [4096], rstd, w, [True, True])[1]]
    runs.append(torch.ops.aten._fused_rms_norm_backward(dy, x, [4096], rstd, w, [True, True])[1])
    assert torch.equal(runs[0], runs[1])
