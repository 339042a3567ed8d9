"""MoE token permutation on CUDA (the native CUDA C++ kernels): the sort by expert equal to
torch's stable sort; values and gradients against
float64 with poisoned allocations, sentinels, the packed and one-element paths, int32 and int64
``valid``, no host synchronisation, CUDA graphs, and the same results as on the CPU."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from torchgraft import functional as tgf
from torchgraft.ops.moe_permute.reference import (
    moe_permute_reference,
    moe_sort_reference,
    moe_unpermute_reference,
)

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPS = torch.ops.torchgraft


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


def _calls(op: str) -> int:
    return torchgraft.stats()[f"native/torchgraft::{op}/CUDA"]["calls"]


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks: outputs a kernel forgets to write
    then read back as NaN instead of stale zeros."""
    torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _routing(tokens: int, top_k: int, experts: int, sentinels: int) -> torch.Tensor:
    scores = torch.rand(tokens, experts + sentinels, device="cuda")
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "hidden", "sentinels"),
    [
        (1, 1, 1, 8, 0),
        (64, 4, 8, 32, 0),
        (33, 8, 16, 24, 5),
        (257, 2, 8, 1000, 2),
        (128, 8, 64, 2048, 8),
        (5, 3, 4, 13, 1),  # rows not a whole number of 16-byte packs: one-element path
    ],
)
@pytest.mark.parametrize("weights_dtype", ["float32", "same", "other", None])
def test_cuda_matches_float64(dtype, tokens, top_k, experts, hidden, sentinels, weights_dtype):
    ids = _routing(tokens, top_k, experts, sentinels)
    perm, inv_perm, _, valid = tgf.moe_sort(ids, experts)
    x0 = torch.randn(tokens, hidden, device="cuda").to(dtype)
    y0 = torch.randn(tokens * top_k, hidden, device="cuda").to(dtype)
    w0 = torch.rand(tokens, top_k, device="cuda")
    if weights_dtype == "same":
        w0 = w0.to(dtype)
    elif weights_dtype == "other":
        w0 = w0.to(torch.float16 if dtype != torch.float16 else torch.bfloat16)
    grad = torch.randn(tokens, hidden, device="cuda").to(dtype)
    dout = torch.randn(tokens * top_k, hidden, device="cuda").to(dtype)
    _poison_allocator(16 * tokens * top_k * hidden * 8)
    before = {op: _calls(op) for op in ("moe_permute", "moe_unpermute", "moe_unpermute_backward")}

    x, x64 = x0.clone().requires_grad_(), x0.double().requires_grad_()
    out = tgf.moe_permute(x, perm, valid, top_k)
    assert torch.equal(out, moe_permute_reference(x0, perm, valid, top_k))
    out.backward(dout)
    moe_permute_reference(x64, perm, valid, top_k).backward(dout.double())
    assert _rel(x.grad, x64.grad) <= TOL[dtype]

    y, y64 = y0.clone().requires_grad_(), y0.double().requires_grad_()
    w = None if weights_dtype is None else w0.clone().requires_grad_()
    w64 = None if w is None else w0.double().requires_grad_()
    back = tgf.moe_unpermute(y, inv_perm, valid, w, top_k)
    ref = moe_unpermute_reference(y64, inv_perm, valid, w64, top_k)
    assert back.dtype == dtype and _rel(back, ref) <= TOL[dtype]
    back.backward(grad)
    ref.backward(grad.double())
    assert bool(y.grad.isfinite().all()) and _rel(y.grad, y64.grad) <= TOL[dtype]
    if w is not None:
        assert w.grad.dtype == w0.dtype and bool(w.grad.isfinite().all())
        tol = max(TOL[w0.dtype], 1e-6 if dtype != torch.float64 else 1e-12)
        assert _rel(w.grad, w64.grad) <= tol
    torch.cuda.synchronize()
    # Without weights, moe_unpermute's backward is moe_permute of the gradient.
    for op, n in before.items():
        ran = op != "moe_unpermute_backward" or weights_dtype is not None
        assert (_calls(op) > n) == ran, op


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "low", "high"),
    [
        (0, 2, 4, 0, 4),
        (1, 1, 1, 0, 1),
        (8192, 8, 64, 0, 64),  # Qwen3-MoE's routing at 2 x 4096 tokens: 32 blocks
        (8192, 2, 8, -2, 11),  # Mixtral's, with other ranks' ids on both sides
        (3001, 6, 160, 0, 170),  # more experts than the block's threads
        (50_000, 8, 2048, -1, 2049),  # the most experts; the block cap (31 chunks)
        (1 << 17, 8, 8, 0, 8),  # 1M pairs: 512 chunks
    ],
)
def test_moe_sort_equals_torchs_stable_sort(tokens, top_k, experts, low, high):
    ids = torch.randint(low, high, (tokens, top_k), device="cuda")
    _poison_allocator(8 * 3 * tokens * top_k + 4096)
    before = _calls("moe_sort")
    got = tgf.moe_sort(ids, experts)
    assert _calls("moe_sort") == before + 1
    for g, w in zip(got, moe_sort_reference(ids, experts), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_moe_sort_beyond_the_kernels_experts_runs_torchs_ops():
    ids = torch.randint(0, 3000, (100, 4), device="cuda")
    before = _calls("moe_sort")
    got = tgf.moe_sort(ids, 3000)
    assert _calls("moe_sort") == before
    for g, w in zip(got, moe_sort_reference(ids, 3000), strict=True):
        assert torch.equal(g, w)
    with pytest.raises(RuntimeError, match="at most 2048 experts, got 3000"):
        OPS.moe_sort(ids, 3000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unaligned_rows_take_the_one_element_path(dtype):
    _, inv_perm, _, valid = tgf.moe_sort(_routing(40, 4, 8, 1), 8)
    base = torch.randn(160 * 64 + 1, device="cuda").to(dtype)
    y = base[1:].view(160, 64)  # 16-byte packs would be misaligned
    w = torch.rand(40, 4, device="cuda")
    got = tgf.moe_unpermute(y, inv_perm, valid, w, 4)
    assert (
        _rel(got, moe_unpermute_reference(y.double(), inv_perm, valid, w.double(), 4)) <= TOL[dtype]
    )


def test_same_results_as_cpu_and_sentinel_rows_zero():
    ids = _routing(50, 4, 8, 3)
    perm, inv_perm, _, valid = tgf.moe_sort(ids, 8)
    y = torch.randn(200, 96, device="cuda")
    y[int(valid) :] = float("nan")  # grouped_mm leaves the sentinel rows unwritten
    w = torch.rand(50, 4, device="cuda")
    grad = torch.randn(50, 96, device="cuda")
    out = tgf.moe_unpermute(y, inv_perm, valid, w, 4)
    out_cpu = tgf.moe_unpermute(y.cpu(), inv_perm.cpu(), valid.cpu(), w.cpu(), 4)
    assert bool(out.isfinite().all()) and _rel(out.cpu(), out_cpu) <= 1e-6
    args = (grad, y, perm, inv_perm, valid, w, 4)
    dy, dw = OPS.moe_unpermute_backward(*args)
    dy_cpu, dw_cpu = OPS.moe_unpermute_backward(
        *(a.cpu() if torch.is_tensor(a) else a for a in args)
    )
    v = int(valid)
    assert bool((dy[v:] == 0).all()) and torch.equal(dy.cpu(), dy_cpu)
    assert bool((dw.reshape(-1)[perm[v:]] == 0).all()) and _rel(dw.cpu(), dw_cpu) <= 1e-6


def test_valid_is_read_on_the_device_without_a_host_sync():
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(32, 2, 4, 1), 4)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tgf.moe_permute(x, perm, valid, 2)
        tgf.moe_permute(x, perm, valid.long(), 2)
        tgf.moe_unpermute(y, inv_perm, valid, None, 2)
        tgf.moe_sort(_routing(32, 2, 4, 1), 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_with_new_routing():
    ids = _routing(16, 2, 4, 1)
    x = torch.randn(16, 32, device="cuda")
    w = torch.rand(16, 2, device="cuda")

    def block() -> torch.Tensor:
        perm, inv_perm, _, valid = tgf.moe_sort(ids, 4)
        rows = tgf.moe_permute(x, perm, valid, 2)
        return tgf.moe_unpermute(rows * 2, inv_perm, valid, w, 2)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    ids.copy_(_routing(16, 2, 4, 1))
    graph.replay()
    assert torch.allclose(out, block())


def test_errors_on_cuda():
    perm, _, _, valid = tgf.moe_sort(_routing(4, 2, 4, 0), 4)
    x = torch.randn(4, 3, device="cuda")
    with pytest.raises(RuntimeError, match="expected expert_ids to have dtype Long, got Int"):
        OPS.moe_sort(perm.int(), 4)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.moe_permute(x, perm.cpu(), valid, 2)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.moe_permute(x, perm, valid.cpu(), 2)
    with pytest.raises(RuntimeError, match="top_k must be at least 1"):
        OPS.moe_permute(x, perm, valid, 0)
    # Index values are not checked on CUDA: an out-of-range slot reads as a sentinel.
    bad = torch.where(perm == perm[0], 10**6, perm)
    out = OPS.moe_permute(x, bad, valid, 2)
    assert bool((out[0] == 0).all())
