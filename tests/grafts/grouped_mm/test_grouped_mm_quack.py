"""quack's grouped GEMM under ``aten::_grouped_mm``, on CPU: what the cond takes and declines,
and the impl's results in ATen's format under ATen's derivative formula and torch.compile, with
an eager stand-in for quack (``fake_quack_gemm_interface.py``)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from dsl_fakes import clear_caches, write_dist, write_module
from torchgraft import registry
from torchgraft.grafts.grouped_mm import grouped_mm_reference
from torchgraft.grafts.grouped_mm import quack_cond as cond
from torchgraft.grafts.grouped_mm import quack_impl as impl

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

_aten = torch.ops.aten
BF16 = torch.bfloat16


def routed(rows: int, groups: int, *, empty: int | None = None, tail: int = 0) -> torch.Tensor:
    """int32 group ends over ``rows - tail`` rows from random sizes; group ``empty`` gets none."""
    weights = torch.rand(groups) + 0.1
    if empty is not None:
        weights[empty] = 0.0
    sizes = (weights / weights.sum() * (rows - tail)).floor().to(torch.int64)
    sizes[-1 if empty != groups - 1 else 0] += rows - tail - int(sizes.sum())
    return sizes.cumsum(0).to(torch.int32)


def experts(rows=96, hidden=32, out=48, groups=4, dtype=BF16):
    """Rows (M, K), weights as transformers keeps them (E, N, K), offsets."""
    return (
        torch.randn(rows, hidden, dtype=dtype),
        torch.randn(groups, out, hidden, dtype=dtype) / hidden**0.5,
        routed(rows, groups),
    )


# ---- the cond ---------------------------------------------------------------------------------


def test_the_expert_gemms_autograd_forms_are_taken():
    a, w, offs = experts()
    grad = torch.randn(a.shape[0], w.shape[1], dtype=BF16)
    for mat_a, mat_b in ((a, w.transpose(-2, -1)), (grad, w), (a.t(), grad), (grad.t(), a)):
        assert cond.why_not(mat_a, mat_b, offs, None, None, capability=(9, 0)) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda a, b, o: (a.half(), b.half(), o, None, None), "dtypes"),
        (lambda a, b, o: (a, b, o, None, torch.float32), "out_dtype"),
        (lambda a, b, o: (a, b, None, None, None), "no offsets"),
        (lambda a, b, o: (a, b, o, torch.zeros(4, 48, dtype=BF16), None), "a bias"),
        (lambda a, b, o: (a, b, o.long(), None, None), "offsets torch.int64"),
        (lambda a, b, o: (a, b, o[:3], None, None), "3 offsets for 4 groups"),
        (lambda a, b, o: (a.t().contiguous().t(), b, o, None, None), "mat_a not row-major"),
        (lambda a, b, o: (a[:, :20], b[:, :20], o, None, None), "K = 20 or N = 48"),
        (lambda a, b, o: (a, b[..., :44], o, None, None), "K = 32 or N = 44"),
        (lambda a, b, o: (a[:, 2:26], b[:, 2:26], o, None, None), "16-byte aligned"),
        (lambda a, b, o: (a[:0], b, o, None, None), "an empty operand"),
        (lambda a, b, o: (a, b[:1].expand(4, -1, -1), o, None, None), "zero-stride"),
        (lambda a, b, o: (a.unsqueeze(0), b, o, None, None), "3-D x 3-D"),
        (lambda a, b, o: (a, b[:, :16], o, None, None), "inner sizes differ"),
    ],
)
def test_what_quack_does_not_take_is_declined(change, words):
    a, w, offs = experts()
    args = change(a, w.transpose(-2, -1), offs)
    reason = cond.why_not(*args, capability=(9, 0))
    assert reason is not None and words in reason


def test_weight_gradients_in_other_layouts_and_other_gpus_are_declined():
    a, w, offs = experts()
    grad = torch.randn(a.shape[0], w.shape[1], dtype=BF16)
    reason = cond.why_not(a.t().contiguous(), grad, offs, None, None, capability=(9, 0))
    assert reason is not None and "column-major" in reason
    for capability in ((8, 0), (10, 0), (12, 0)):
        reason = cond.why_not(a, w.transpose(-2, -1), offs, None, None, capability=capability)
        assert reason is not None and "sm90 only" in reason
    assert cond.why_not(a, w.transpose(-2, -1), offs, None, None) == "device cpu"
    assert not cond.grouped_mm_cond(a, w.transpose(-2, -1), offs)


def test_a_failed_import_declines_everything(monkeypatch):
    a, w, offs = experts()
    monkeypatch.setattr(impl.QUACK, "error", "ImportError: no cutlass")
    reason = cond.why_not(a, w.transpose(-2, -1), offs, None, None, capability=(9, 0))
    assert reason is not None and "could not be imported" in reason


# ---- the impl, with an eager stand-in for quack ----------------------------------------------


@pytest.fixture
def fake_quack(fake_root):
    """quack.gemm_interface = fake_quack_gemm_interface.py; quack imported afresh."""
    write_dist(fake_root, "quack-kernels", "0.6.5")
    write_module(fake_root, "quack", "")
    (fake_root / "quack" / "gemm_config.py").write_text(
        "def default_config(device):\n    return 'sm90 default'\n"
    )
    shutil.copy(
        Path(__file__).resolve().parents[2] / "fake_quack_gemm_interface.py",
        fake_root / "quack" / "gemm_interface.py",
    )
    clear_caches()
    impl.QUACK.reset()
    module = impl.QUACK.get()
    assert module is not None, impl.QUACK.error
    from quack import gemm_interface

    gemm_interface.CALLS.clear()
    return gemm_interface


def meta_of(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("weight_major", ["k", "n"])
def test_impl_matches_the_meta_function_and_the_reference(fake_quack, weight_major):
    a, w, _ = experts()
    offs = routed(a.shape[0], w.shape[0], empty=1, tail=5)
    b = w.transpose(-2, -1) if weight_major == "k" else w.transpose(-2, -1).contiguous()
    ours = impl.grouped_mm_impl(a, b, offs)
    meta = _aten._grouped_mm(meta_of(a), meta_of(b), meta_of(offs))
    assert ours.shape == meta.shape and ours.stride() == meta.stride() and ours.dtype == BF16
    valid = int(offs[-1])
    assert rel_err(ours[:valid], grouped_mm_reference(a, b, offs)[:valid]) < 1e-2
    grad = torch.randn(a.shape[0], w.shape[1], dtype=BF16)
    weight_grad = impl.grouped_mm_impl(a.t(), grad, offs)
    meta = _aten._grouped_mm(meta_of(a.t()), meta_of(grad), meta_of(offs))
    assert weight_grad.shape == meta.shape and weight_grad.stride() == meta.stride()
    assert rel_err(weight_grad, grouped_mm_reference(a.t(), grad, offs)) < 1e-2
    assert weight_grad[1].count_nonzero() == 0  # the empty group's gradient
    assert [kind for kind, _, _ in fake_quack.CALLS] == ["varlen_m", "varlen_k"]


def _register_at_cpu() -> None:
    # ATen's CPU kernel is the one below; the impl takes every call its cond would take on a GPU.
    def take(a, b, offs=None, bias=None, out_dtype=None):
        return cond.why_not(a, b, offs, bias, out_dtype, capability=(9, 0)) is None

    registry.register_op_override(
        "cutedsl", "aten", "_grouped_mm", "CPU", take, impl.grouped_mm_impl
    )


def _experts_loss(a, w, offs, grad):
    return (torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).double() * grad).sum()


def test_aten_autograd_runs_the_impl_for_all_three_gemms(fake_quack):
    _register_at_cpu()
    a, w, _ = experts()
    offs = routed(a.shape[0], w.shape[0], empty=2)
    a.requires_grad_()
    w.requires_grad_()
    grad = torch.randn(a.shape[0], w.shape[1], dtype=torch.float64)
    _experts_loss(a, w, offs, grad).backward()
    a64, w64 = (t.detach().double().requires_grad_() for t in (a, w))
    (grouped_mm_reference(a64, w64.transpose(-2, -1), offs) * grad).sum().backward()
    assert rel_err(a.grad, a64.grad) < 1e-2 and rel_err(w.grad, w64.grad) < 1e-2
    assert a.grad.stride() == a.stride() and w.grad.stride() == w.stride()
    assert w.grad[2].count_nonzero() == 0
    # forward, the rows' gradient (varlen M), the weights' gradient (varlen K: grad^T x rows)
    assert sorted(kind for kind, _, _ in fake_quack.CALLS) == ["varlen_k", "varlen_m", "varlen_m"]


def test_torch_compile_plans_with_the_meta_function_and_runs_the_impl(fake_quack):
    _register_at_cpu()
    a, w, offs = experts()
    a.requires_grad_()
    w.requires_grad_()
    grad = torch.randn(a.shape[0], w.shape[1], dtype=torch.float64)
    compiled = torch.compile(_experts_loss, backend="aot_eager", fullgraph=True, dynamic=False)
    compiled(a, w, offs, grad).backward()
    a64, w64 = (t.detach().double().requires_grad_() for t in (a, w))
    (grouped_mm_reference(a64, w64.transpose(-2, -1), offs) * grad).sum().backward()
    assert rel_err(a.grad, a64.grad) < 1e-2 and rel_err(w.grad, w64.grad) < 1e-2
    assert len(fake_quack.CALLS) == 3


def test_a_call_quack_refuses_goes_to_aten(fake_quack, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise AssertionError("varlen not supported with swap_ab")

    monkeypatch.setattr(impl.QUACK.get(), "_run", refuse)
    a, w, offs = experts()
    with caplog.at_level(logging.WARNING):
        ours = impl.grouped_mm_impl(a, w.transpose(-2, -1), offs)
    assert "quack refused a grouped GEMM its cond accepted" in caplog.text
    assert torch.equal(ours, torch._grouped_mm(a, w.transpose(-2, -1), offs=offs))
    assert not impl.QUACK.failed  # one refusal is not a broken install
