"""quack's CuteDSL RMSNorm and the Helion RMSNorm under ``F.rms_norm`` on a GPU, against the
float64 reference, forward and backward, alone and on top of the native route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from conftest import rel_err
from torchgraft import native, registry
from torchgraft.dsl import cutedsl
from torchgraft.dsl import helion as helion_dsl
from torchgraft.grafts.rms_norm import (
    dsl_cond,
    dsl_impl,
    helion_configs,
    rms_norm_backward_reference,
    rms_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.usefixtures("clean_overrides"),
]


def _quack_unusable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        return "quack's RMSNorm is taken on sm90/sm100 only"
    return cutedsl.library_unusable_reason("quack-kernels")


needs_quack = pytest.mark.skipif(_quack_unusable() is not None, reason=f"{_quack_unusable()}")
needs_helion = pytest.mark.skipif(
    helion_dsl.runtime.unusable_reason() is not None,
    reason=f"helion unusable: {helion_dsl.runtime.unusable_reason()}",
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: (shape, dtype): each pair is one compile per kernel and library, so few of them.
CASES = [
    ((4096, 4096), torch.bfloat16),
    ((37, 1000), torch.bfloat16),
    ((8, 16384), torch.bfloat16),
    ((3, 5, 2048), torch.float32),
]
#: The Helion kernels' cases: rows up to its bound (dsl_cond.HELION_MAX_HIDDEN).
HELION_CASES = [c for c in CASES if c[0][-1] <= dsl_cond.HELION_MAX_HIDDEN]


@pytest.fixture
def route(request):
    torchgraft.disable()
    torchgraft.enable(routes=[request.param])
    yield request.param
    torchgraft.disable()


def check(route_name, shape, dtype, with_weight=True):
    hidden = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True) if with_weight else None
    y = F.rms_norm(x, [hidden], w, 1e-6)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref, rstd_ref = rms_norm_reference(
        x.detach(), [hidden], w.detach() if w is not None else None, 1e-6
    )
    dx_ref, dw_ref = rms_norm_backward_reference(
        grad, x.detach(), [hidden], rstd_ref, w.detach() if w is not None else None
    )
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(x.grad, dx_ref) < max(TOL[dtype], 1e-4)
    if w is not None:
        assert rel_err(w.grad, dw_ref) < max(TOL[dtype], 1e-4)
    kernels = dsl_impl.QUACK if route_name == "cutedsl" else dsl_impl.HELION
    assert not kernels.failed, kernels.error  # a failed import falls back, counted as a call
    stats = registry.override_stats()
    assert stats[f"{route_name}/aten::_fused_rms_norm/CUDA"] == {"calls": 1, "fallbacks": 0}
    assert stats[f"{route_name}/aten::_fused_rms_norm_backward/CUDA"] == {
        "calls": 1,
        "fallbacks": 0,
    }


@needs_quack
@pytest.mark.parametrize("route", ["cutedsl"], indirect=True)
@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_quack_route(route, shape, dtype):
    check(route, shape, dtype)


@needs_quack
@pytest.mark.parametrize("route", ["cutedsl"], indirect=True)
def test_quack_without_weight_and_in_fp16(route):
    check(route, (64, 4096), torch.float16, with_weight=False)


@needs_helion
@pytest.mark.parametrize("route", ["helion"], indirect=True)
@pytest.mark.parametrize(("shape", "dtype"), HELION_CASES)
def test_helion_route(route, shape, dtype):
    check(route, shape, dtype)


@needs_helion
@pytest.mark.parametrize("route", ["helion"], indirect=True)
def test_helion_declines_rows_wider_than_its_bound(route):
    hidden = dsl_cond.HELION_MAX_HIDDEN * 2
    x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    y = F.rms_norm(x, [hidden], w, 1e-6)
    assert rel_err(y, rms_norm_reference(x, [hidden], w, 1e-6)[0]) < TOL[torch.bfloat16]
    assert registry.override_stats()["helion/aten::_fused_rms_norm/CUDA"] == {
        "calls": 0,
        "fallbacks": 1,
    }


@needs_helion
def test_every_shipped_helion_config_compiles_and_runs():
    for entry in helion_configs.load_entries():
        dtype = torch.float32 if entry.dtypes == "float32" else torch.bfloat16
        x = torch.randn(300, entry.hidden, device="cuda", dtype=dtype)
        w = torch.randn(entry.hidden, device="cuda", dtype=dtype)
        y, rstd = dsl_impl.helion_forward_impl(x, [entry.hidden], w, 1e-6)
        dx, dw = dsl_impl.helion_backward_impl(
            torch.ones_like(x), x, [entry.hidden], rstd, w, [True, True]
        )
        y_ref, _ = rms_norm_reference(x, [entry.hidden], w, 1e-6)
        assert rel_err(y, y_ref) < TOL[dtype], entry
        assert dx.isfinite().all() and dw.isfinite().all(), entry


@needs_quack
@pytest.mark.skipif(not native.available(), reason="the native extension is not built")
def test_quack_on_top_of_native_falls_back_to_it():
    torchgraft.disable()
    torchgraft.enable(routes=["native", "cutedsl"])
    try:
        x = torch.randn(64, 4097, device="cuda", dtype=torch.bfloat16)  # odd: quack declines
        w = torch.randn(4097, device="cuda", dtype=torch.bfloat16)
        y = F.rms_norm(x, [4097], w, 1e-6)
        assert rel_err(y, rms_norm_reference(x, [4097], w, 1e-6)[0]) < 1e-2
        stats = torchgraft.stats()
        assert stats["cutedsl/aten::_fused_rms_norm/CUDA"] == {"calls": 0, "fallbacks": 1}
        assert stats["native/aten::_fused_rms_norm/CUDA"]["calls"] == 1
    finally:
        torchgraft.disable()
