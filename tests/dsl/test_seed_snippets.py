"""The blog's two snippets (seed 000), unchanged apart from the import line.

``triton_kernels.triton_rms_norm_forward`` is a stand-in here (float64 RMSNorm that counts its
calls); the real Triton kernels come from torchgraft.grafts.rms_norm. The snippets register at
"CUDA": on a machine without a GPU the tests check the registration and run the very same
functions registered at "CPU", which exercises the routing, the unconditional override and the
re-entrant fallback for small shapes. The CUDA runs are marked ``cuda``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from torchgraft import registry

# ---------------------------------------------------------------- seed 000, snippet 1 (verbatim)
"""Register a Triton-based RMSNorm as a native op override using torch._native."""
from torchgraft.dsl import triton as triton_utils  # noqa: E402  (was: from torch._native import ...)

pytestmark = pytest.mark.default_torch


def _triton_fused_rms_norm(dispatch_keys, x, normalized_shape, weight, eps):
    """
    Wrapper that lazily imports the Triton kernel on first call.
    """
    from triton_kernels import triton_rms_norm_forward

    return triton_rms_norm_forward(x, normalized_shape, weight, eps)


def register():
    """Register the Triton RMSNorm override."""
    triton_utils.register_op_override(
        "aten",  # lib_symbol: override an aten op
        "_fused_rms_norm",  # op_symbol: the specific op
        "CUDA",  # dispatch_key: only on CUDA
        _triton_fused_rms_norm,  # impl: our wrapper
        unconditional_override=False,  # receives dispatch_keys as first arg
    )


# ---------------------------------------------------------------- seed 000, snippet 2 (verbatim)
def _smart_rms_norm(dispatch_keys, x, normalized_shape, weight, eps):
    n_rows = x.numel() // normalized_shape[-1]
    if n_rows < 4096:
        # Fall back to default C++ kernel for small shapes..
        return torch.ops.aten._fused_rms_norm.default(x, normalized_shape, weight, eps)
    from triton_kernels import triton_rms_norm_forward

    return triton_rms_norm_forward(x, normalized_shape, weight, eps)


# ---------------------------------------------------------------- the stand-in kernel module
class StandInKernels(types.ModuleType):
    """``triton_kernels`` for the tests: RMSNorm computed in float64, with a call counter."""

    def __init__(self) -> None:
        super().__init__("triton_kernels")
        self.calls = 0

    def triton_rms_norm_forward(
        self,
        x: torch.Tensor,
        normalized_shape: list[int],
        weight: torch.Tensor | None,
        eps: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        if eps is None:
            eps = torch.finfo(acc).eps
        dims = list(range(-len(normalized_shape), 0))
        x64 = x.double()
        rrms = torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + eps)
        y = x64 * rrms
        if weight is not None:
            y = y * weight.double()
        return y.to(x.dtype), rrms.to(acc)


@pytest.fixture
def kernels(monkeypatch, clean_overrides):
    module = StandInKernels()
    monkeypatch.setitem(sys.modules, "triton_kernels", module)
    return module


@pytest.fixture
def triton_usable():
    reason = triton_utils.runtime.unusable_reason()
    if reason is not None:
        pytest.skip(f"triton overrides are not registered here: {reason}")


def rms_norm64(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, eps: float):
    dims = list(range(-len(normalized_shape), 0))
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + eps) * weight.double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def register_at(key: str, impl) -> None:
    """The snippet's registration call, with another dispatch key."""
    triton_utils.register_op_override(
        "aten", "_fused_rms_norm", key, impl, unconditional_override=False
    )


# ---------------------------------------------------------------- registration as written ("CUDA")
@pytest.mark.usefixtures("triton_usable")
def test_register_installs_a_router_at_cuda(kernels):
    cpu_table_before = torch._C._dispatch_dump_table("aten::_fused_rms_norm")
    register()
    (info,) = registry.list_overrides()
    assert (info.dsl, info.op, info.dispatch_key) == ("triton", "aten::_fused_rms_norm", "CUDA")
    assert info.installed and info.with_keyset and not info.unconditional
    table = torch._C._dispatch_dump_table("aten::_fused_rms_norm")
    cuda_line = next(line for line in table.splitlines() if line.startswith("CUDA:"))
    assert "torchgraft" in cuda_line  # our router sits at CUDA
    cpu_line = next(line for line in table.splitlines() if line.startswith("CPU:"))
    assert cpu_line in cpu_table_before  # CPU untouched (footnote 3 of the post)
    triton_utils.deregister_op_overrides()
    assert torch._C._dispatch_dump_table("aten::_fused_rms_norm") == cpu_table_before
    assert kernels.calls == 0


# ---------------------------------------------------------------- the same functions at "CPU"
@pytest.mark.usefixtures("triton_usable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unconditional_override_on_cpu(kernels, dtype):
    x = torch.randn(16, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    ref = rms_norm64(x, [64], w, 1e-6)
    register_at("CPU", _triton_fused_rms_norm)
    y, rrms = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    assert kernels.calls == 1
    assert rel_err(y, ref) < (1e-12 if dtype == torch.float64 else 1e-6)
    assert rrms.shape == (16, 1)
    # Model code is unchanged: F.rms_norm reaches the override too.
    out = F.rms_norm(x, [64], w, 1e-6)
    assert kernels.calls == 2
    assert rel_err(out, ref) < (1e-12 if dtype == torch.float64 else 1e-6)


@pytest.mark.usefixtures("triton_usable")
def test_smart_gate_on_cpu_falls_back_for_small_shapes(kernels):
    large = torch.randn(4, 1024, 32)  # 4 * 1024 = 4096 rows -> the (stand-in) Triton kernel
    tiny = torch.randn(8, 32)  # 8 rows -> the default kernel
    w = torch.randn(32)
    stock_tiny = torch.ops.aten._fused_rms_norm(tiny, [32], w, 1e-6)
    register_at("CPU", _smart_rms_norm)

    y, rrms = torch.ops.aten._fused_rms_norm(tiny, [32], w, 1e-6)
    assert kernels.calls == 0  # re-entered the op and reached ATen's kernel, no recursion
    assert torch.equal(y, stock_tiny[0]) and torch.equal(rrms, stock_tiny[1])

    y = F.rms_norm(large, [32], w, 1e-6)
    assert kernels.calls == 1
    assert rel_err(y, rms_norm64(large, [32], w, 1e-6)) < 1e-6
    stats = registry.override_stats()["triton/aten::_fused_rms_norm/CPU"]
    assert stats == {"calls": 2, "fallbacks": 1}  # both calls entered the gate; one fell back


@pytest.mark.usefixtures("triton_usable")
def test_smart_gate_boundary_on_cpu(kernels):
    w = torch.randn(16)
    register_at("CPU", _smart_rms_norm)
    torch.ops.aten._fused_rms_norm(torch.randn(4095, 16), [16], w, None)
    assert kernels.calls == 0
    torch.ops.aten._fused_rms_norm(torch.randn(4096, 16), [16], w, None)
    assert kernels.calls == 1


# ---------------------------------------------------------------- on a GPU, exactly as written
@pytest.mark.cuda
@pytest.mark.usefixtures("triton_usable")
def test_unconditional_override_on_cuda(kernels):
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    register()
    y, _ = torch.ops.aten._fused_rms_norm(x, [256], w, 1e-6)
    assert kernels.calls == 1
    assert rel_err(y, rms_norm64(x, [256], w, 1e-6)) < 1e-6
    F.rms_norm(x, [256], w, 1e-6)
    assert kernels.calls == 2
    # CPU tensors keep ATen's kernel.
    torch.ops.aten._fused_rms_norm(x.cpu(), [256], w.cpu(), 1e-6)
    assert kernels.calls == 2


@pytest.mark.cuda
@pytest.mark.usefixtures("triton_usable")
def test_smart_gate_on_cuda(kernels):
    w = torch.randn(128, device="cuda")
    tiny = torch.randn(32, 128, device="cuda")
    big = torch.randn(8192, 128, device="cuda")
    stock_tiny = torch.ops.aten._fused_rms_norm(tiny, [128], w, 1e-6)
    triton_utils.register_op_override(
        "aten", "_fused_rms_norm", "CUDA", _smart_rms_norm, unconditional_override=False
    )
    y, rrms = torch.ops.aten._fused_rms_norm(tiny, [128], w, 1e-6)
    assert kernels.calls == 0
    assert torch.equal(y, stock_tiny[0]) and torch.equal(rrms, stock_tiny[1])
    y = F.rms_norm(big, [128], w, 1e-6)
    assert kernels.calls == 1
    assert rel_err(y, rms_norm64(big, [128], w, 1e-6)) < 1e-6
