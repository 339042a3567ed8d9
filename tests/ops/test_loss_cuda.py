"""cross_entropy and linear_cross_entropy on CUDA (the CUDA C++ kernels, cuBLAS through aten):
values and gradients against float64, in place, memory, streams, errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.cross_entropy.reference import cross_entropy_reference

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]


@pytest.fixture(autouse=True)
def _own_rng():
    """Seeded random numbers that leave the global generator as they found it (the tests
    after these ones see the same random inputs with or without them)."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(0)
        yield


GRAD_TOL = {torch.float64: 1e-12, torch.float32: 3e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
LOSS_TOL = {torch.float64: 1e-12, torch.float32: 3e-6, torch.bfloat16: 3e-6, torch.float16: 3e-6}
DTYPES = list(GRAD_TOL)


def _inputs(shape, dtype, seed=0, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], generator=g)
    if ignore_every:
        target.view(-1)[1::ignore_every] = -100
    return logits, target


def _rel(out, ref, floor=0.0):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / max(ref.norm().item(), floor)).item()


@pytest.mark.parametrize("inplace", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(1, 1), (9, 7), (3, 5, 1001), (6, 50257), (2, 128256)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_matches_float64(dtype, shape, reduction, label_smoothing, inplace):
    base, target = _inputs(shape, dtype)
    leaf = base.cuda().requires_grad_()
    logits = leaf * 1 if inplace else leaf
    loss = tgf.cross_entropy(
        logits,
        target.cuda(),
        reduction=reduction,
        label_smoothing=label_smoothing,
        inplace_backward=inplace,
    )
    go = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    x = base.double().requires_grad_()
    ref = cross_entropy_reference(x, target, -100, reduction, label_smoothing)
    ref.backward(go)
    loss.backward(go.to(loss.dtype).cuda())
    assert loss.shape == ref.shape and loss.device.type == "cuda"
    assert _rel(loss, ref, 1.0) < LOSS_TOL[dtype]
    floor = go.norm().item() / max(target.numel(), 1)
    assert _rel(leaf.grad, x.grad, floor) < GRAD_TOL[dtype]


def test_all_ignored_empty_and_masked_rows():
    for reduction in ("mean", "sum", "none"):
        logits = torch.randn(4, 33, device="cuda", requires_grad=True)
        target = torch.full((4,), -100, device="cuda")
        got = tgf.cross_entropy(logits, target, reduction=reduction)
        want = F.cross_entropy(logits.detach(), target, reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)
        got.sum().backward()
        assert not logits.grad.any()
        empty = torch.randn(0, 33, device="cuda", requires_grad=True)
        got = tgf.cross_entropy(empty, target[:0], reduction=reduction)
        want = F.cross_entropy(empty.detach(), target[:0], reduction=reduction)
        torch.testing.assert_close(got, want, equal_nan=True)
    logits = torch.randn(3, 5000, device="cuda")
    logits[:, :4000] = float("-inf")  # whole blocks of threads see only -inf
    logits[2, 17] = float("nan")
    target = torch.tensor([4500, 4999, 4100], device="cuda")
    got = tgf.cross_entropy(logits, target, reduction="none")
    want = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(got, want, equal_nan=True)


def test_inplace_uses_no_memory_beyond_the_logits():
    n, v = 512, 32000
    leaf = torch.randn(n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    # The backward's matmul runs on autograd's device thread, whose cuBLAS handle allocates
    # its workspace (32 MiB on the H100) at its first use: make that happen before measuring.
    (leaf @ w).sum().backward()
    leaf.grad = None
    logits = leaf @ w
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = tgf.cross_entropy(logits, target, inplace_backward=True)
    del logits
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # Backward of the matmul needs its own output (n x 64) and the weight's grad is not wanted;
    # the loss adds only per-row losses and a count.
    assert extra < n * v * 2 // 4, extra


def test_side_stream():
    base, target = _inputs((64, 3001), torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = base.cuda().requires_grad_()
        loss = tgf.cross_entropy(x, target.cuda())
        loss.backward()
    stream.synchronize()
    ref = F.cross_entropy(base.double(), target)
    assert _rel(loss, ref) < LOSS_TOL[torch.bfloat16]


def test_out_of_range_target_fails_a_device_assertion():
    code = textwrap.dedent(
        """
        import torch
        from torchgraft import functional as tgf
        x = torch.randn(4, 10, device="cuda")
        loss = tgf.cross_entropy(x, torch.tensor([1, 2, 10, 3], device="cuda"))
        torch.cuda.synchronize()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    # ATen's wording ("device-side assert triggered") or the driver's (CUDA_ERROR_ASSERT).
    assert "assert" in (out.stdout + out.stderr).lower(), out.stderr


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 100])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_matches_float64(dtype, bias, chunk_size, reduction):
    g = torch.Generator().manual_seed(0)
    n, h, v = 333, 64, 5003
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 3).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[::7] = -100
    leaves = [t.cuda().requires_grad_() for t in (hidden, weight)]
    bl = b.cuda().requires_grad_() if bias else None
    loss = tgf.linear_cross_entropy(
        leaves[0], leaves[1], target.cuda(), bl, reduction=reduction, chunk_size=chunk_size
    )
    go = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    loss.backward(go.to(loss.dtype).cuda())
    ref_args = [t.double().requires_grad_() for t in (hidden, weight)]
    rb = b.double().requires_grad_() if bias else None
    ref = cross_entropy_reference(F.linear(ref_args[0], ref_args[1], rb), target, -100, reduction)
    ref.backward(go)
    tol = 3e-6 if dtype == torch.float32 else 2e-2
    assert _rel(loss, ref) < tol
    assert _rel(leaves[0].grad, ref_args[0].grad) < tol
    assert _rel(leaves[1].grad, ref_args[1].grad) < tol
    if bias:
        assert _rel(bl.grad, rb.grad) < tol


def test_linear_cross_entropy_never_materializes_the_logits():
    n, h, v = 8192, 256, 32000  # 1024-row chunks: an eighth of the logits at a time
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tgf.linear_cross_entropy(hidden, weight, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    logits_bytes = n * v * 2
    grads_bytes = (n * h + v * h) * 2
    assert extra < grads_bytes + logits_bytes // 4, (extra, logits_bytes)


def test_runs_the_native_cuda_kernels():
    reset_stats()
    x = torch.randn(8, 100, device="cuda", requires_grad=True)
    t = torch.randint(0, 100, (8,), device="cuda")
    tgf.cross_entropy(x, t).backward()
    w = torch.randn(100, 16, device="cuda", requires_grad=True)
    tgf.linear_cross_entropy(torch.randn(8, 16, device="cuda"), w, t).backward()
    got = stats()
    assert got["native/torchgraft::cross_entropy/CUDA"]["calls"] == 1
    assert got["native/torchgraft::scale_grad/CUDA"]["calls"] == 1
    assert got["native/torchgraft::linear_cross_entropy/CUDA"]["calls"] == 1
    assert got["native/torchgraft::scale_grad_/CUDA"]["calls"] == 3


def test_compiles_fullgraph_on_cuda():
    x = torch.randn(16, 40, device="cuda")
    w = torch.randn(300, 40, device="cuda", requires_grad=True)
    t = torch.randint(0, 300, (16,), device="cuda")

    def step(x, w):
        return tgf.linear_cross_entropy(x, w, t) + tgf.cross_entropy(x @ w.T, t)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(x, w)
    out.backward()
    w2 = w.detach().clone().requires_grad_()
    ref = step(x, w2)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.grad, w2.grad)
