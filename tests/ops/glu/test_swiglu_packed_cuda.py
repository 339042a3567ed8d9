"""torchgraft.functional.swiglu_packed on CUDA (graft-cuda's packed SwiGLU kernels): values and
gradients against float64, both kernel paths (16-byte packs and single elements), the in-place
backward."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err_in
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.glu.reference import swiglu_packed_reference

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]

OPS = torch.ops.torchgraft
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# float64 gradients: SiLU's derivative cancels near x = -1.28, where few elements show the
# kernel's and the reference's roundings amplified (as in test_glu_cuda.py).
GRAD_TOL = {torch.float64: 1e-10}
# (..., 2I): I a multiple of every pack size (768: Qwen3-MoE), I not one (7, 33, 100), odd
# row counts, 3-D, empty.
SHAPES = [(1, 2), (7, 14), (33, 2 * 33), (257, 2 * 100), (65, 2 * 768), (2, 5, 2 * 64), (0, 8)]


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks: outputs a kernel forgets to write
    then read back as NaN instead of stale values."""
    torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _gate_up(shape, dtype, requires_grad=False) -> torch.Tensor:
    """Fresh random values, the gate half scaled as pre-activations are."""
    x = torch.randn(shape, dtype=torch.float64, device="cuda")
    x[..., : shape[-1] // 2] *= 3
    return x.to(dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_cuda_matches_float64(shape, dtype, offset):
    # `offset` elements into a fresh allocation: off 16-byte alignment, the one-element kernels.
    values = _gate_up(shape, torch.float64)
    storage = torch.empty(values.numel() + offset, dtype=dtype, device="cuda")
    gate_up = storage[offset:].view(shape).copy_(values).requires_grad_()
    half = (*shape[:-1], shape[-1] // 2)
    dy = torch.randn(half, dtype=torch.float64, device="cuda").to(dtype)
    _poison_allocator(8 * max(gate_up.numel(), 1) * 4)
    y = tgf.swiglu_packed(gate_up)
    y.backward(dy)
    gu64 = gate_up.detach().double().requires_grad_()
    y64 = swiglu_packed_reference(gu64)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == half and y.is_cuda
    if y.numel() == 0:
        return
    for out in (y, gate_up.grad):
        assert torch.isfinite(out).all()
    assert rel_err_in(y, y64) < TOL[dtype]
    assert rel_err_in(gate_up.grad, gu64.grad) < GRAD_TOL.get(dtype, 2 * TOL[dtype])


def test_cuda_runs_the_native_kernels_on_the_current_stream():
    reset_stats()
    gate_up = _gate_up((1024, 2 * 768), torch.bfloat16, requires_grad=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = tgf.swiglu_packed(gate_up)
        y.sum().backward()
    stream.synchronize()
    assert rel_err_in(y, swiglu_packed_reference(gate_up)) < TOL[torch.bfloat16]
    got = stats()
    assert got["native/torchgraft::swiglu_packed/CUDA"]["calls"] == 1
    assert got["native/torchgraft::swiglu_packed_backward/CUDA"]["calls"] == 1


def test_cuda_gradcheck_float64():
    gate_up = _gate_up((6, 22), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tgf.swiglu_packed, (gate_up,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_inplace_backward_writes_the_gradient_over_gate_up(dtype):
    reset_stats()
    x = torch.randn(64, 128, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(128, 2 * 96, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 96, device="cuda", dtype=dtype)
    grads = []
    for inplace in (False, True):
        gate_up = x @ w
        seen = {}
        gate_up.register_hook(lambda g, seen=seen: seen.setdefault("grad", g))
        tgf.swiglu_packed(gate_up, inplace_backward=inplace).backward(dy)
        assert (seen["grad"].data_ptr() == gate_up.data_ptr()) == inplace
        grads.append([t.grad.clone() for t in (x, w)])
        x.grad = w.grad = None
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert stats()["native/torchgraft::swiglu_packed_backward_/CUDA"]["calls"] == 1


@pytest.mark.parametrize("cols", [7, 64], ids=["one-element", "packs"])
def test_cuda_inplace_op_matches_the_allocating_op(cols):
    gate_up = _gate_up((37, 2 * cols), torch.bfloat16)
    dy = torch.randn(37, cols, device="cuda").to(torch.bfloat16)
    want = OPS.swiglu_packed_backward(dy, gate_up)
    got = gate_up.clone()
    OPS.swiglu_packed_backward_(dy, got)
    assert torch.equal(got, want)
    # A strided gate_up and a gradient that is its own gate half: computed, then copied in.
    wide = torch.cat([gate_up, gate_up[:, :4]], dim=1)
    view = wide[:, : 2 * cols]
    OPS.swiglu_packed_backward_(dy, view)
    assert torch.equal(view, want)
    g = gate_up.clone()
    want = OPS.swiglu_packed_backward(g[:, :cols].clone(), g)
    OPS.swiglu_packed_backward_(g[:, :cols], g)
    assert torch.equal(g, want)


def test_cuda_opcheck_and_compile():
    gate_up = _gate_up((5, 12), torch.float32, requires_grad=True)
    torch.library.opcheck(OPS.swiglu_packed, (gate_up,))
    grad = torch.randn(5, 6, device="cuda")
    torch.library.opcheck(OPS.swiglu_packed_backward, (grad, gate_up.detach()))
    torch.library.opcheck(OPS.swiglu_packed_backward_, (grad, gate_up.detach().clone()))
    compiled = torch.compile(lambda t: tgf.swiglu_packed(t).sum(), fullgraph=True)
    compiled(gate_up).backward()
    got = gate_up.grad.clone()
    gate_up.grad = None
    tgf.swiglu_packed(gate_up).sum().backward()
    torch.testing.assert_close(got, gate_up.grad)
