"""SwiGLU / GeGLU on CUDA (the native CUDA C++ kernels): values and gradients against float64."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err, rel_err_in
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.glu.reference import geglu_reference, swiglu_reference

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# float64 gradients: GeGLU's derivative Phi(x) + x phi(x) cancels near x = -0.75 (and SiLU's
# near x = -1.28), where a tensor of one element shows the kernel's and the reference's
# roundings amplified a thousandfold (seen: 2.3e-12 on the H100); still 1e5 below float32.
GRAD_TOL = {torch.float64: 1e-10}
OPS = {
    "swiglu": (tgf.swiglu, swiglu_reference),
    "geglu": (tgf.geglu, lambda g, u: geglu_reference(g, u, "none")),
    "geglu_tanh": (
        lambda g, u: tgf.geglu(g, u, approximate="tanh"),
        lambda g, u: geglu_reference(g, u, "tanh"),
    ),
}


def _gate_grad_err(
    out: torch.Tensor, ref: torch.Tensor, dy: torch.Tensor, up: torch.Tensor
) -> float:
    """The gate gradient's error: dgate = dy * up * act'(gate), where act' is a difference of
    terms of about 1 that can cancel to nearly 0 (GRAD_TOL); against a reference whose norm is
    at least a tenth of dy * up's, so that a drawn gate next to act''s zero (one element) does
    not turn the kernel's and the reference's roundings into a large relative error."""
    floor = 0.1 * float((dy.double() * up.detach().double()).norm())
    ref64 = ref.detach().double()
    return float((out.detach().double() - ref64).norm() / max(float(ref64.norm()), floor, 1e-300))


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks: outputs a kernel forgets to write
    then read back as NaN instead of stale zeros."""
    torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device="cuda").fill_(float("nan"))


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 13), (257, 1000), (64, 8192), (0, 4)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_cuda_matches_float64(name, dtype, shape, offset):
    op, ref = OPS[name]
    n = int(torch.tensor(shape).prod())
    base = torch.randn(3, n + offset, dtype=torch.float64, device="cuda")
    # `offset` shifts the data pointers off 16-byte alignment: the scalar kernels run.
    gate = (3 * base[0, offset:]).to(dtype).view(shape).requires_grad_()
    up = base[1, offset:].to(dtype).view(shape).requires_grad_()
    dy = base[2, offset:].to(dtype).view(shape)
    _poison_allocator(8 * max(n, 1) * 4)
    y = op(gate, up)
    y.backward(dy)
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    y64 = ref(g64, u64)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == gate.shape and y.is_cuda
    if n == 0:
        return
    for out in (y, gate.grad, up.grad):
        assert torch.isfinite(out).all()
    assert rel_err_in(y, y64) < TOL[dtype]
    assert _gate_grad_err(gate.grad, g64.grad, dy, up) < GRAD_TOL.get(dtype, 2 * TOL[dtype])
    assert rel_err_in(up.grad, u64.grad) < GRAD_TOL.get(dtype, 2 * TOL[dtype])


def test_cuda_runs_the_native_kernels_on_the_current_stream():
    reset_stats()
    gate = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = tgf.swiglu(gate, up)
        y.sum().backward()
    stream.synchronize()
    ref = torch.nn.functional.silu(gate.float()) * up.float()
    assert rel_err(y, ref) < TOL[torch.bfloat16]
    got = stats()
    assert got["native/torchgraft::swiglu/CUDA"]["calls"] == 1
    assert got["native/torchgraft::swiglu_backward/CUDA"]["calls"] == 1


def test_cuda_gradcheck_float64():
    gate = torch.randn(6, 11, dtype=torch.float64, device="cuda", requires_grad=True)
    up = torch.randn(6, 11, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(tgf.swiglu, (gate, up))
    assert torch.autograd.gradcheck(lambda g, u: tgf.geglu(g, u, "tanh"), (gate, up))
