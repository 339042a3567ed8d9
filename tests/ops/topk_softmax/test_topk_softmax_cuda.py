"""torchgraft.functional.topk_softmax on the GPU (the CUDA C++ kernels, one warp per token):
weights and experts against float64 on fresh random logits, the register kernels (up to 512
experts) and the loop kernel, k = 1 to experts, renormalized or not, every floating dtype, ties
and special values in the CPU kernel's order, outputs written over poisoned memory, gradients,
streams, layouts, empty inputs and the counters that show the kernels ran. Runs on a GPU
machine; skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from torchgraft import functional as tgf
from torchgraft import native, reset_stats, stats
from torchgraft.ops.topk_softmax.reference import topk_softmax_reference

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
"""Relative error of the weights: computed in float32 (float64) from logits that float32 holds
exactly, whatever their dtype."""
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""Relative error of the logits' gradient, rounded to the logits' dtype."""
SHAPES = [
    # (tokens, experts, k): register kernels v1 (8), v2 (64), v4 (128), v8 (160), v16 (512),
    # the loop kernel (513, 1000); k = 1, k = experts, k > 32 (picks held by several lanes).
    (1, 8, 1),
    (37, 8, 2),
    (300, 8, 8),
    (257, 64, 1),
    (1000, 64, 8),
    (64, 64, 64),
    (4096, 128, 8),
    (77, 128, 128),
    (33, 160, 40),
    (19, 512, 8),
    (23, 513, 8),
    (5, 1000, 33),
]


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    if not any(
        k.op == "torchgraft::topk_softmax" and k.dispatch_key == "CUDA" and k.active
        for k in native.op_kernels()
    ):
        pytest.skip(f"no CUDA kernels for torchgraft::topk_softmax: {native.build_info()}")


def _generator() -> tuple[torch.Generator, int]:
    """A generator with a fresh seed (reported by the assertions that use it)."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device="cuda").manual_seed(seed), seed


def _logits(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64) * 3).to(dtype)


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks: outputs a kernel forgets to write
    then read back as NaN (indices as huge values) instead of stale data."""
    torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm())


def _calls(op: str) -> int:
    return stats()[f"native/torchgraft::{op}/CUDA"]["calls"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["probs", "renormalized"])
@pytest.mark.parametrize(("tokens", "experts", "k"), SHAPES)
def test_cuda_matches_float64(dtype, renormalize, tokens, experts, k):
    gen, seed = _generator()
    logits = _logits((tokens, experts), dtype, gen)
    _poison_allocator(tokens * max(experts, k) * 16)
    before = _calls("topk_softmax")
    weights, indices = tgf.topk_softmax(logits, k, renormalize=renormalize)
    assert _calls("topk_softmax") == before + 1
    want_w, want_i = topk_softmax_reference(logits.double(), k, renormalize)
    assert weights.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert indices.dtype == torch.int64 and weights.shape == indices.shape == (tokens, k)
    assert weights.is_cuda and indices.is_cuda
    assert torch.isfinite(weights).all(), f"seed {seed}"
    assert torch.equal(indices, want_i), f"seed {seed}"
    assert _rel(weights, want_w) <= TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["probs", "renormalized"])
@pytest.mark.parametrize(
    ("tokens", "experts", "k"), [(64, 8, 8), (300, 64, 6), (50, 128, 128), (9, 600, 40)]
)
def test_cuda_ties_and_special_values_go_as_on_the_cpu(dtype, renormalize, tokens, experts, k):
    """Equal logits (multiples of 0.5 in [-2, 2]: every row has many) give the lower expert
    first; a NaN or +inf logit makes its row NaN, all -inf too, picked in expert order. The
    CPU kernel's experts exactly, its weights within rounding (NaN where it has NaN)."""
    gen, seed = _generator()
    logits = (torch.randint(-4, 5, (tokens, experts), generator=gen, device="cuda") / 2).to(dtype)
    logits[0, experts // 2] = float("nan")
    logits[1, -1] = float("inf")
    logits[2] = float("-inf")
    logits[3, 0] = float("-inf")
    _poison_allocator(tokens * experts * 16)
    weights, indices = tgf.topk_softmax(logits, k, renormalize=renormalize)
    cpu_w, cpu_i = tgf.topk_softmax(logits.cpu(), k, renormalize=renormalize)
    assert torch.equal(indices.cpu(), cpu_i), f"seed {seed}"
    assert torch.equal(weights[:3].isnan().cpu(), torch.ones(3, k, dtype=torch.bool))
    assert torch.equal(indices[:3].cpu(), torch.arange(k).expand(3, k))
    assert torch.isfinite(weights[3:]).all()
    torch.testing.assert_close(weights.cpu(), cpu_w, rtol=TOL[dtype], atol=0, equal_nan=True)
    assert torch.equal(indices, topk_softmax_reference(logits, k, renormalize)[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["probs", "renormalized"])
@pytest.mark.parametrize(
    ("tokens", "experts", "k"), [(37, 8, 2), (513, 64, 8), (64, 128, 128), (11, 700, 35)]
)
def test_cuda_gradients_match_float64(dtype, renormalize, tokens, experts, k):
    gen, seed = _generator()
    logits = _logits((tokens, experts), dtype, gen).requires_grad_()
    grad = torch.randn(tokens, k, generator=gen, device="cuda", dtype=torch.float64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    _poison_allocator(tokens * experts * 16)
    before = _calls("topk_softmax_backward")
    tgf.topk_softmax(logits, k, renormalize=renormalize)[0].backward(grad.to(acc))
    assert _calls("topk_softmax_backward") == before + 1
    x64 = logits.detach().double().requires_grad_()
    topk_softmax_reference(x64, k, renormalize)[0].backward(grad)
    assert logits.grad.dtype == dtype and logits.grad.shape == logits.shape
    assert torch.isfinite(logits.grad).all(), f"seed {seed}"
    assert _rel(logits.grad, x64.grad) <= GRAD_TOL[dtype], f"seed {seed}"
    if renormalize:
        # Only the selected logits get a gradient.
        chosen = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
        chosen.scatter_(1, topk_softmax_reference(x64.detach(), k, True)[1], True)
        assert (logits.grad[~chosen] == 0).all()


@pytest.mark.parametrize("renormalize", [False, True], ids=["probs", "renormalized"])
def test_cuda_gradcheck_float64(renormalize):
    logits = torch.randn(9, 40, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: tgf.topk_softmax(x, 5, renormalize=renormalize)[0], (logits,)
    )


def test_cuda_runs_the_native_kernels_on_the_current_stream():
    reset_stats()
    logits = torch.randn(8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        weights, indices = tgf.topk_softmax(logits, 8, renormalize=True)
        weights.sum().backward()
    stream.synchronize()
    want_w, want_i = topk_softmax_reference(logits.detach().double(), 8, True)
    assert torch.equal(indices, want_i)
    assert _rel(weights, want_w) <= TOL[torch.bfloat16]
    got = stats()
    assert got["native/torchgraft::topk_softmax/CUDA"]["calls"] == 1
    assert got["native/torchgraft::topk_softmax_backward/CUDA"]["calls"] == 1


def test_cuda_takes_strided_and_empty_logits():
    logits = torch.randn(64, 50, device="cuda").t()  # (50 tokens, 64 experts), not contiguous
    weights, indices = tgf.topk_softmax(logits, 4)
    want_w, want_i = topk_softmax_reference(logits.double(), 4, False)
    assert torch.equal(indices, want_i) and _rel(weights, want_w) <= TOL[torch.float32]
    empty = torch.randn(0, 16, device="cuda", requires_grad=True)
    weights, indices = tgf.topk_softmax(empty, 2, renormalize=True)
    assert weights.shape == indices.shape == (0, 2)
    weights.sum().backward()
    assert empty.grad.shape == (0, 16)


def test_cuda_errors_are_the_cpus():
    logits = torch.randn(4, 6, device="cuda")
    for k in (0, 7):
        with pytest.raises(RuntimeError, match="selected index k out of range"):
            torch.ops.torchgraft.topk_softmax(logits, k, False)
    with pytest.raises(RuntimeError, match="expected logits to have 2 dimensions, got 1"):
        torch.ops.torchgraft.topk_softmax(torch.randn(6, device="cuda"), 1, False)
