"""quack's grouped GEMM under ``aten::_grouped_mm`` on a Hopper GPU: the three expert GEMMs
against the float64 reference (outputs poisoned first), through ATen's autograd after
``torchgraft.enable()``, under torch.compile and a CUDA graph, and the calls left to ATen."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from conftest import rel_err
from torchgraft.dsl import cutedsl
from torchgraft.grafts.grouped_mm import grouped_mm_reference
from torchgraft.grafts.grouped_mm import quack_impl as impl

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.usefixtures("clean_overrides"),
]

BF16 = torch.bfloat16


def _unusable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability()[0] != 9:
        return "quack's grouped GEMM is taken on sm90 only"
    return cutedsl.library_unusable_reason("quack-kernels")


pytestmark.append(pytest.mark.skipif(_unusable() is not None, reason=f"{_unusable()}"))


def routed(rows: int, groups: int, top_k: int = 2, *, empty=(), tail: int = 0) -> torch.Tensor:
    """int32 group ends of a random top-k routing of ``rows // top_k`` tokens over ``rows - tail``
    rows (groups in ``empty`` get none)."""
    logits = torch.randn(rows // top_k, groups, device="cuda")
    logits[:, list(empty)] = float("-inf")
    ids = logits.topk(top_k, dim=-1).indices.flatten()[: rows - tail]
    return torch.bincount(ids, minlength=groups).cumsum(0).to(torch.int32)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach quack."""
    kernels = impl.QUACK.get()
    assert kernels is not None, impl.QUACK.error
    seen: list[str] = []
    run = kernels.grouped_mm

    def counted(a, b, offs):
        seen.append("varlen_m" if b.dim() == 3 else "varlen_k")
        return run(a, b, offs)

    monkeypatch.setattr(kernels, "grouped_mm", counted)
    return seen


def poisoned_like(shape: tuple[int, ...]) -> None:
    """Leave a NaN-filled block of ``shape`` in the caching allocator, so an output allocated
    next at that size starts as NaN and unwritten elements show."""
    block = torch.full(shape, float("nan"), device="cuda", dtype=BF16)
    del block


SHAPES = [  # rows, hidden, out features, groups, top-k
    (4096, 256, 384, 8, 2),
    (8192, 512, 256, 64, 8),
    (1000, 128, 136, 5, 1),  # rows not a multiple of any tile
]


@pytest.mark.parametrize(("rows", "hidden", "out", "groups", "top_k"), SHAPES)
@pytest.mark.parametrize("weight_major", ["k", "n"])
def test_three_gemms_match_the_reference(rows, hidden, out, groups, top_k, weight_major):
    kernels = impl.QUACK.get()
    assert kernels is not None, impl.QUACK.error
    offs = routed(rows, groups, top_k, empty=(1,), tail=top_k * 3)
    a = torch.randn(rows, hidden, device="cuda", dtype=BF16)
    w = torch.randn(groups, out, hidden, device="cuda", dtype=BF16) / hidden**0.5
    b = w.transpose(-2, -1) if weight_major == "k" else w.transpose(-2, -1).contiguous()
    valid = int(offs[-1])
    poisoned_like((rows, out))
    y = kernels.grouped_mm(a, b, offs)
    assert rel_err(y[:valid], grouped_mm_reference(a, b, offs)[:valid]) < 1e-2
    assert not y[:valid].isnan().any()
    grad = torch.randn(rows, out, device="cuda", dtype=BF16)
    poisoned_like((rows, hidden))
    dx = kernels.grouped_mm(grad, w if weight_major == "k" else b.transpose(-2, -1), offs)
    assert rel_err(dx[:valid], grouped_mm_reference(grad, w, offs)[:valid]) < 1e-2
    poisoned_like((groups, hidden, out))
    dw = kernels.grouped_mm(a.t(), grad, offs)
    want = grouped_mm_reference(a.t(), grad, offs)
    assert not dw.isnan().any()  # every group written, the empty one as zeros
    assert rel_err(dw, want) < 1e-2 and dw[1].count_nonzero() == 0


def experts_step(rows=8192, hidden=512, out=768, groups=64, top_k=8):
    offs = routed(rows, groups, top_k, empty=(3,))
    a = torch.randn(rows, hidden, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(groups, out, hidden, device="cuda", dtype=BF16) / hidden**0.5).requires_grad_()
    grad = torch.randn(rows, out, device="cuda", dtype=torch.float64)
    return a, w, offs, grad


def experts_loss(a, w, offs, grad):
    return (torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).double() * grad).sum()


def reference_grads(a, w, offs, grad):
    a64, w64 = (t.detach().double().requires_grad_() for t in (a, w))
    (grouped_mm_reference(a64, w64.transpose(-2, -1), offs) * grad).sum().backward()
    return a64.grad, w64.grad


def test_enable_grafts_all_three_gemms_of_autograd(calls):
    a, w, offs, grad = experts_step()
    torchgraft.enable()
    try:
        experts_loss(a, w, offs, grad).backward()
    finally:
        torchgraft.disable()
    ra, rw = reference_grads(a, w, offs, grad)
    assert rel_err(a.grad, ra) < 1e-2 and rel_err(w.grad, rw) < 1e-2
    assert w.grad[3].count_nonzero() == 0
    assert sorted(calls) == ["varlen_k", "varlen_m", "varlen_m"]
    calls.clear()
    experts_loss(a, w, offs, grad).backward()  # disabled: ATen's kernel
    assert calls == []


def test_torch_compile_and_cuda_graphs_run_the_graft(calls):
    a, w, offs, grad = experts_step(rows=2048, groups=16, top_k=4)
    torchgraft.enable()
    try:
        compiled = torch.compile(experts_loss, fullgraph=True, dynamic=False)
        compiled(a, w, offs, grad).backward()
        ra, rw = reference_grads(a, w, offs, grad)
        assert rel_err(a.grad, ra) < 1e-2 and rel_err(w.grad, rw) < 1e-2
        assert len(calls) >= 1  # inductor may lower some of the three itself
        calls.clear()
        x, weight = a.detach(), w.detach().transpose(-2, -1)
        eager = torch._grouped_mm(x, weight, offs=offs)
        graph = torch.cuda.CUDAGraph()
        torch._grouped_mm(x, weight, offs=offs)  # compiled kernels before capture
        with torch.cuda.graph(graph):
            captured = torch._grouped_mm(x, weight, offs=offs)
        graph.replay()
        torch.cuda.synchronize()
        valid = int(offs[-1])
        assert torch.equal(captured[:valid], eager[:valid])
    finally:
        torchgraft.disable()


@pytest.mark.parametrize(
    "case", ["float16", "bias", "float32 out", "int64 offsets", "no offsets", "unaligned"]
)
def test_calls_the_cond_declines_run_atens_kernel(calls, case):
    a, w, offs, _ = experts_step(rows=1024, groups=8, top_k=2)
    a, b = a.detach(), w.detach().transpose(-2, -1)
    kwargs: dict[str, object] = {"offs": offs}
    if case == "float16":
        a, b = a.half(), b.half()
    elif case == "bias":
        kwargs["bias"] = torch.randn(8, b.shape[-1], device="cuda", dtype=BF16)
    elif case == "float32 out":
        kwargs["out_dtype"] = torch.float32
    elif case == "int64 offsets":
        kwargs["offs"] = offs.long()
    elif case == "no offsets":
        a, b, kwargs = a.view(8, 128, -1), b, {}
    else:
        a, b = a[:, 4:-4], b[:, 4:-4]
    try:
        want = torch._grouped_mm(a, b, **kwargs)
    except (RuntimeError, ValueError) as error:
        torchgraft.enable()
        try:
            with pytest.raises(type(error)):
                torch._grouped_mm(a, b, **kwargs)
        finally:
            torchgraft.disable()
    else:
        torchgraft.enable()
        try:
            got = torch._grouped_mm(a, b, **kwargs)
        finally:
            torchgraft.disable()
        assert torch.equal(got, want)
    assert calls == []
