"""The cuTile RMSNorm under ``F.rms_norm`` on a GPU, against the float64 reference, forward and
backward, through the route (``enable(routes=["cutile"])``) and through the impls directly.

Each (row length, dtype) is one compile per kernel on first use (seconds; tens of seconds for
the backward at some widths), so the cases are few. Outputs are allocated from memory poisoned
with NaN first, so a row the kernels do not write fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from conftest import rel_err
from torchgraft import registry
from torchgraft.dsl import cutile
from torchgraft.grafts.rms_norm import (
    default_eps,
    dsl_cond,
    dsl_impl,
    rms_norm_backward_reference,
    rms_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.usefixtures("clean_overrides"),
]


def _cutile_unusable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    reason = cutile.runtime.unusable_reason()
    if reason is not None:
        return reason
    return cutile.arch_unusable_reason(torch.cuda.get_device_capability()[0])


pytestmark.append(
    pytest.mark.skipif(_cutile_unusable() is not None, reason=f"{_cutile_unusable()}")
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: (shape, dtype): odd rows and an odd row length, Llama's 4096 (one row a program), a
#: training batch (8 x 4096 x 4096: many row blocks per backward program), both 16-bit dtypes
#: and float32, and the widest row the conds take.
CASES = [
    ((37, 1000), torch.bfloat16),
    ((4097, 4096), torch.bfloat16),
    ((8, 4096, 4096), torch.bfloat16),
    ((33, 4096), torch.float16),
    ((3, 5, 2048), torch.float32),
    ((5, dsl_cond.CUTILE_MAX_HIDDEN), torch.bfloat16),
]


@pytest.fixture
def route():
    torchgraft.disable()
    torchgraft.enable(routes=["cutile"])
    yield "cutile"
    torchgraft.disable()


def _poison_free_memory(numel: int) -> None:
    """Fill the caching allocator's free blocks with NaN, so what it hands out next holds NaN."""
    torch.full((numel,), float("nan"), device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()


def _reference(x, w, grad, eps):
    """``(y, rstd, dx, dw)`` in float64."""
    hidden = x.shape[-1]
    x64, w64 = x.detach().double(), w.detach().double()
    y, rstd = rms_norm_reference(x64, [hidden], w64, eps)
    dx, dw = rms_norm_backward_reference(grad.double(), x64, [hidden], rstd, w64)
    return y, rstd, dx, dw


def _inputs(shape, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3 + 0.5
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    grad = torch.randn(shape, device="cuda", dtype=dtype)
    return x, w, grad


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_cutile_route_matches_the_reference(route, shape, dtype):
    hidden = shape[-1]
    x, w, grad = _inputs(shape, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    _poison_free_memory(4 * x.numel())
    y = F.rms_norm(x, [hidden], w, 1e-6)
    y.backward(grad)
    y_ref, _, dx_ref, dw_ref = _reference(x, w, grad, 1e-6)
    assert not dsl_impl.CUTILE.failed, dsl_impl.CUTILE.error
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(x.grad, dx_ref) < max(TOL[dtype], 1e-4)
    assert rel_err(w.grad, dw_ref) < max(TOL[dtype], 1e-4)
    stats = registry.override_stats()
    assert stats["cutile/aten::_fused_rms_norm/CUDA"] == {"calls": 1, "fallbacks": 0}
    assert stats["cutile/aten::_fused_rms_norm_backward/CUDA"] == {"calls": 1, "fallbacks": 0}


@pytest.mark.parametrize(("shape", "dtype"), [CASES[0], CASES[4]])
def test_cutile_impls_return_what_aten_returns(shape, dtype):
    hidden = shape[-1]
    x, w, grad = _inputs(shape, dtype)
    _poison_free_memory(4 * x.numel())
    y, rstd = dsl_impl.cutile_forward_impl(x, [hidden], w, None)  # eps None: ATen's default
    # ATen's default eps comes from the computation dtype (float32's for 16-bit inputs).
    y_ref, rstd_ref, dx_ref, dw_ref = _reference(x, w, grad, default_eps(dtype))
    assert y.shape == x.shape and y.dtype == dtype
    assert rstd.shape == rstd_ref.shape and rstd.dtype == torch.float32
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(rstd, rstd_ref) < 1e-5
    for mask in ([True, True], [True, False], [False, True]):
        _poison_free_memory(4 * x.numel())
        dx, dw = dsl_impl.cutile_backward_impl(grad, x, [hidden], rstd, w, mask)
        assert (dx is None) == (not mask[0]) and (dw is None) == (not mask[1])
        if dx is not None:
            assert dx.shape == x.shape and dx.dtype == dtype
            assert rel_err(dx, dx_ref) < max(TOL[dtype], 1e-4)
        if dw is not None:
            assert dw.shape == w.shape and dw.dtype == dtype
            assert rel_err(dw, dw_ref) < max(TOL[dtype], 1e-4)


def test_cutile_backward_repeats_bitwise():
    # dw is summed per program into partials reduced in order: no atomics.
    x, w, grad = _inputs((4097, 4096), torch.bfloat16)
    _, rstd = dsl_impl.cutile_forward_impl(x, [4096], w, 1e-6)
    first = dsl_impl.cutile_backward_impl(grad, x, [4096], rstd, w, [True, True])
    second = dsl_impl.cutile_backward_impl(grad, x, [4096], rstd, w, [True, True])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_cutile_declines_what_it_does_not_take(route):
    hidden = dsl_cond.CUTILE_MAX_HIDDEN * 2
    x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    y = F.rms_norm(x, [hidden], w, 1e-6)
    assert rel_err(y, _reference(x, w, x, 1e-6)[0]) < TOL[torch.bfloat16]
    F.rms_norm(torch.randn(4, 64, device="cuda", dtype=torch.bfloat16), [64], None, 1e-6)
    assert registry.override_stats()["cutile/aten::_fused_rms_norm/CUDA"] == {
        "calls": 0,
        "fallbacks": 2,
    }
