"""Impl results are checked: structure every call, metadata per input signature, values in strict
mode (issue 10 items 2 and 3). A bad impl gets a clear error naming it, never a crash or a
silently wrong tensor."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from torchgraft import registry
from torchgraft.grafts.rms_norm.reference import rms_norm_backward_reference, rms_norm_reference
from torchgraft.registry import outputs

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

REPO = Path(__file__).resolve().parents[2]


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 reference without aten::mm (which the tests override)."""
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


def mm64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ref_mm(a, b).to(a.dtype)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a crash there cannot take the test run down)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **env},
    )


# ----------------------------------------------------------------------------- structure


def test_three_outputs_for_a_two_output_op_is_an_error_not_a_crash():
    # Issue 10 item 2, verbatim: this used to kill the process in the dispatcher.
    result = run_python(
        """
        import torch, torch.nn.functional as F
        from torchgraft import register_op_override
        register_op_override(
            "x", "aten", "_fused_rms_norm", "CPU", lambda *a: True,
            lambda x, ns, w, eps: (*torch.ops.aten._fused_rms_norm.default(x, ns, w, eps), x),
        )
        try:
            F.rms_norm(torch.randn(4, 8), [8])
        except RuntimeError as exc:
            print("raised:", exc)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "raised: torchgraft override x/aten::_fused_rms_norm/CPU" in result.stdout
    assert "returned 3 value(s)" in result.stdout
    assert "returns 2: (Tensor, Tensor)" in result.stdout


def test_a_list_of_three_in_a_compiled_graph_is_an_error_not_a_crash():
    # The opaque op of the compile path runs the impl too: same check there.
    result = run_python(
        """
        import torch
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torchgraft import registry
        registry.register_op_override(
            "x", "aten", "_fused_rms_norm", "CPU", lambda *a: True,
            lambda x, ns, w, eps: [x, x, x],
        )
        backend = aot_autograd(
            fw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
            decompositions=registry.native_decomp_table(),
        )
        f = torch.compile(lambda x: torch.ops.aten._fused_rms_norm(x, [8], None, None)[0],
                          backend=backend, fullgraph=True)
        try:
            f(torch.randn(4, 8))
        except Exception as exc:
            print("raised:", type(exc).__name__, exc)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "raised:" in result.stdout and "returned 3 value(s)" in result.stdout


@pytest.mark.parametrize(
    ("impl", "match"),
    [
        (lambda a, b: None, "the output is None, the op returns a torch.float32 tensor"),
        (lambda a, b: (mm64(a, b),), r"output 0 is tuple\[Tensor\(4, 2\)\]"),
        (lambda a, b: 3, "output 0 is int, aten::mm returns a Tensor there"),
        (lambda a, b: mm64(a, b).tolist(), "output 0 is list"),
    ],
)
def test_single_output_op_gets_a_tensor_or_an_error(impl, match):
    registry.register_op_override("bad", "aten", "mm", "CPU", lambda a, b: True, impl)
    with pytest.raises(registry.OverrideResultError, match=match):
        torch.mm(torch.randn(4, 8), torch.randn(8, 2))


def test_two_output_op_returning_one_tensor_is_an_error():
    registry.register_op_override(
        "bad", "aten", "_fused_rms_norm", "CPU", lambda *a: True, lambda x, ns, w, eps: x
    )
    with pytest.raises(RuntimeError, match=r"returned 1 value\(s\), Tensor\(4, 8\)"):
        F.rms_norm(torch.randn(4, 8), [8])


def test_no_return_op_accepts_none_only():
    xs = [torch.randn(3), torch.randn(5)]
    expected = [x.double() + 2 for x in xs]

    def good(self, scalar):
        for t in self:
            t.copy_(t + scalar)

    registry.register_op_override(
        "ok", "aten", "_foreach_add_.Scalar", "CPU", None, good, unconditional_override=True
    )
    torch._foreach_add_(xs, 2.0)
    assert all(rel_err(x, e) < 1e-6 for x, e in zip(xs, expected, strict=True))
    registry.clear_overrides()
    registry.register_op_override(
        "bad",
        "aten",
        "_foreach_add_.Scalar",
        "CPU",
        None,
        lambda self, s: self,
        unconditional_override=True,
    )
    with pytest.raises(registry.OverrideResultError, match="returns 0"):
        torch._foreach_add_(xs, 2.0)


# ----------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    ("impl", "match"),
    [
        (
            lambda a, b: torch.empty(4, 2, device="meta"),
            "the output is on meta, the op's is on cpu",
        ),
        (lambda a, b: mm64(a, b).half(), "dtype torch.float16, the op's is torch.float32"),
        (lambda a, b: mm64(a, b).t().contiguous(), r"shape \(2, 4\), the op's is \(4, 2\)"),
        (lambda a, b: mm64(a, b)[:3], r"shape \(3, 2\), the op's is \(4, 2\)"),
    ],
)
def test_wrong_shape_dtype_or_device_names_the_override_and_the_difference(impl, match):
    # Issue 10 item 3: these used to reach the caller unchecked.
    def bad_mm(a, b):
        return impl(a, b)

    registry.register_op_override("mydsl", "aten", "mm", "CPU", lambda a, b: True, bad_mm)
    with pytest.raises(registry.OverrideResultError) as info:
        torch.mm(torch.randn(4, 8), torch.randn(8, 2))
    message = str(info.value)
    assert "mydsl/aten::mm/CPU" in message and "DSL 'mydsl'" in message
    assert "bad_mm" in message
    assert __import__("re").search(match, message), message


def test_wrong_rstd_shape_of_a_two_output_op():
    def impl(x, ns, w, eps):
        y, rstd = torch.ops.aten._fused_rms_norm.default(x, ns, w, eps)  # the kernel below
        return y, rstd.view(-1)

    registry.register_op_override("mydsl", "aten", "_fused_rms_norm", "CPU", lambda *a: True, impl)
    with pytest.raises(RuntimeError, match=r"output 1 has shape \(4,\), the op's is \(4, 1\)"):
        F.rms_norm(torch.randn(4, 8), [8])


def test_view_op_strides_are_checked():
    # aten::view returns a view of its input (Tensor(a)): its strides are part of the result.
    x = torch.randn(2, 4)

    def bad_view(self, size):
        return torch.empty_strided((4, 2), (1, 4)).copy_(self.reshape(4, 2))

    registry.register_op_override("mydsl", "aten", "view", "CPU", lambda *a: True, bad_view)
    with pytest.raises(RuntimeError, match=r"strides \(1, 4\), the op's are \(2, 1\)"):
        torch.ops.aten.view.default(x, [4, 2])


def test_metadata_is_checked_once_per_input_signature(monkeypatch):
    runs = []
    real = outputs.expected_result

    def counting(overload, args, kwargs):
        runs.append(tuple(args[0].shape))
        return real(overload, args, kwargs)

    monkeypatch.setattr(outputs, "expected_result", counting)
    registry.register_op_override("ok", "aten", "mm", "CPU", lambda a, b: True, mm64)
    b = torch.randn(8, 2)
    for _ in range(5):
        torch.mm(torch.randn(4, 8), b)
    assert runs == [(4, 8)]
    torch.mm(torch.randn(3, 8), b)  # a new shape: checked once more
    torch.mm(torch.randn(4, 8).double(), b.double())  # a new dtype: too
    for _ in range(3):
        torch.mm(torch.randn(3, 8), b)
    assert runs == [(4, 8), (3, 8), (4, 8)]


def test_remembered_signatures_are_bounded(monkeypatch):
    monkeypatch.setattr(outputs, "MAX_SIGNATURES", 4)
    registry.register_op_override("ok", "aten", "mm", "CPU", lambda a, b: True, mm64)
    b = torch.randn(8, 2)
    for rows in range(1, 10):
        torch.mm(torch.randn(rows, 8), b)
    (node,) = registry._slots[("aten", "mm", "CPU")].nodes
    assert len(node.checked) == 4


def test_correct_impls_pass_on_every_dtype_and_layout():
    # The checks must never reject a right answer: aten's own conventions, as the reference
    # computes them (compute_dtype=None), for every dtype, a strided input, weight or none.
    def fwd(x, ns, w, eps):
        return rms_norm_reference(x, ns, w, eps, compute_dtype=None)

    def bwd(grad, x, ns, rstd, w, mask):
        return rms_norm_backward_reference(grad, x, ns, rstd, w, mask, compute_dtype=None)

    registry.register_op_override(
        "ok", "aten", "_fused_rms_norm", "CPU", None, fwd, unconditional_override=True
    )
    registry.register_op_override(
        "ok", "aten", "_fused_rms_norm_backward", "CPU", None, bwd, unconditional_override=True
    )
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.randn(6, 5, 16, dtype=dtype).transpose(0, 1).requires_grad_()
        for w in (torch.randn(16, dtype=dtype, requires_grad=True), None):
            y = F.rms_norm(x, [16], w)
            y.sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
            x.grad = None
    stats = registry.override_stats()
    assert stats["ok/aten::_fused_rms_norm/CPU"]["calls"] == 8
    assert stats["ok/aten::_fused_rms_norm_backward/CPU"]["calls"] == 8


# ----------------------------------------------------------------------------- strict mode


def test_strict_mode_checks_every_call_and_records_the_error(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    runs = []
    real = outputs.expected_result

    def counting(overload, args, kwargs):
        runs.append(1)
        return real(overload, args, kwargs)

    monkeypatch.setattr(outputs, "expected_result", counting)

    def off_by_a_bit(a, b):
        return (ref_mm(a, b) + 1e-3).to(a.dtype)

    registry.register_op_override("mydsl", "aten", "mm", "CPU", lambda a, b: True, off_by_a_bit)
    a, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    for _ in range(3):
        torch.mm(a, b)
    assert len(runs) == 3
    stats = registry.override_stats()["mydsl/aten::mm/CPU"]
    assert stats["calls"] == 3 and stats["shadow_checks"] == 3
    assert stats["max_error"] == pytest.approx(1e-3, rel=1e-6)
    (info,) = registry.list_overrides()
    assert info.shadow_checks == 3 and info.max_error == pytest.approx(1e-3, rel=1e-6)
    registry.reset_stats()
    assert registry.override_stats()["mydsl/aten::mm/CPU"] == {"calls": 0, "fallbacks": 0}


def test_strict_mode_exact_impl_has_zero_error_and_nan_disagreement_is_inf(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    a = torch.randn(4, 8)
    a[0, 0] = float("nan")  # NaN rows agree with the kernel below: no error
    registry.register_op_override(
        "exact",
        "aten",
        "mm",
        "CPU",
        lambda p, q: True,
        lambda p, q: torch.ops.aten.mm.default(p, q),
    )
    torch.mm(a, torch.randn(8, 2))
    assert registry.override_stats()["exact/aten::mm/CPU"]["max_error"] == 0.0
    registry.clear_overrides()
    registry.register_op_override(
        "nan", "aten", "mm", "CPU", lambda p, q: True, lambda p, q: torch.full((4, 2), math.nan)
    )
    torch.mm(torch.randn(4, 8), torch.randn(8, 2))
    assert registry.override_stats()["nan/aten::mm/CPU"]["max_error"] == math.inf


def test_strict_mode_in_place_op_writes_once(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    x, y = torch.randn(16), torch.randn(16)
    expected = x.double() + 2 * y.double()

    def add_(self, other, *, alpha=1):
        self.copy_((self.double() + alpha * other.double()).to(self.dtype))
        return self

    registry.register_op_override("mydsl", "aten", "add_.Tensor", "CPU", lambda *a, **k: True, add_)
    assert x.add_(y, alpha=2) is x
    assert rel_err(x, expected) < 1e-6  # the shadow run wrote into a copy, not into x
    stats = registry.override_stats()["mydsl/aten::add_.Tensor/CPU"]
    assert stats["shadow_checks"] == 1 and stats["max_error"] < 1e-6


def test_strict_mode_out_variant(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    a, b = torch.randn(6), torch.randn(6)
    out = torch.full((6,), math.nan)

    def add_out(self, other, *, alpha=1, out):
        out.copy_((self.double() + alpha * other.double()).to(out.dtype))
        return out

    registry.register_op_override("mydsl", "aten", "add.out", "CPU", lambda *a, **k: True, add_out)
    assert torch.add(a, b, out=out) is out
    assert rel_err(out, a.double() + b.double()) < 1e-6
    assert registry.override_stats()["mydsl/aten::add.out/CPU"]["max_error"] < 1e-6


def test_strict_mode_without_a_kernel_below_checks_metadata_only(monkeypatch):
    # _fused_rms_norm_backward has no CPU kernel on stock torch: nothing to shadow against.
    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    if torch._C._dispatch_has_computed_kernel_for_dispatch_key(
        "aten::_fused_rms_norm_backward", "CPU"
    ):
        pytest.skip("this torch has a CPU kernel for _fused_rms_norm_backward")

    def bwd(grad, x, ns, rstd, w, mask):
        return torch.zeros_like(x), None

    registry.register_op_override(
        "mydsl", "aten", "_fused_rms_norm_backward", "CPU", None, bwd, unconditional_override=True
    )
    x = torch.randn(4, 8)
    rstd = torch.ones(4, 1)
    dx, dw = torch.ops.aten._fused_rms_norm_backward(
        torch.randn(4, 8), x, [8], rstd, None, [True, False]
    )
    assert dw is None and dx.shape == x.shape
    assert (
        "shadow_checks" not in registry.override_stats()["mydsl/aten::_fused_rms_norm_backward/CPU"]
    )


# ----------------------------------------------------------------------------- on the GPU

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
compiles_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="Triton kernels are interpreted in this run"
)


@pytest.mark.cuda
@needs_gpu
def test_cuda_impl_returning_a_cpu_tensor_is_an_error():
    registry.register_op_override(
        "mydsl", "aten", "mm", "CUDA", lambda a, b: True, lambda a, b: mm64(a.cpu(), b.cpu())
    )
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(8, 2, device="cuda")
    with pytest.raises(registry.OverrideResultError, match="is on cpu, the op's is on cuda"):
        torch.mm(a, b)


@pytest.mark.cuda
@needs_gpu
@compiles_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_under_strict_mode_matches_aten(monkeypatch, dtype):
    # Shadow verification on the GPU: torchgraft's Triton RMSNorm against ATen's CUDA kernels
    # below it, forward and backward, at a size its cond takes (the headline shape).
    from torchgraft.grafts import rms_norm

    monkeypatch.setenv("TORCHGRAFT_STRICT", "1")
    rms_norm.register()
    try:
        x = torch.randn(8, 4096, 4096, dtype=dtype, device="cuda", requires_grad=True)
        w = torch.randn(4096, dtype=dtype, device="cuda", requires_grad=True)
        y = F.rms_norm(x, [4096], w)
        # A dense upstream gradient: the backward's cond declines sum()'s expanded one.
        y.backward(torch.randn_like(y))
        stats = registry.override_stats()
        fwd = stats["triton/aten::_fused_rms_norm/CUDA"]
        bwd = stats["triton/aten::_fused_rms_norm_backward/CUDA"]
        assert fwd["calls"] == 1 and fwd["shadow_checks"] == 1
        assert bwd["calls"] == 1 and bwd["shadow_checks"] == 1
        # Two correct kernels differ by rounding: a few units in the last place of the
        # largest value (generous: 64 units).
        eps = torch.finfo(dtype).eps
        assert fwd["max_error"] <= 64 * eps * y.detach().abs().max().item()
        largest_grad = max(x.grad.abs().max().item(), w.grad.abs().max().item())
        assert bwd["max_error"] <= 64 * eps * largest_grad
    finally:
        rms_norm.deregister()
