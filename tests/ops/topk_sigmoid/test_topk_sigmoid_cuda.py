"""torchgraft.functional.topk_sigmoid on the GPU (the CUDA C++ kernels): weights and experts
against float64 on fresh random logits, with and without a correction bias, one group or
several, k up to the kept groups' experts, renormalized and scaled or not, every floating
dtype, ties and NaN in the CPU kernel's order, outputs written over poisoned memory, gradients,
streams, layouts, empty inputs and the counters that show the kernels ran. Runs on a GPU
machine; skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from torchgraft import functional as tgf
from torchgraft import native, reset_stats, stats
from torchgraft.ops.topk_sigmoid.reference import topk_sigmoid_reference

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
    # (tokens, experts, k, groups, topk_groups): no groups, DeepSeek-V3's 8 groups / 4 kept,
    # GLM-4.5's 160 experts in one group, more groups than lanes, wide rows.
    (1, 8, 1, 1, 1),
    (37, 8, 2, 4, 2),
    (1000, 64, 8, 8, 4),
    (4096, 256, 8, 8, 4),
    (300, 160, 8, 1, 1),
    (77, 128, 16, 64, 10),
    (33, 384, 24, 12, 3),
    (5, 1024, 40, 8, 2),
]


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    if not any(
        k.op == "torchgraft::topk_sigmoid" and k.dispatch_key == "CUDA" and k.active
        for k in native.op_kernels()
    ):
        pytest.skip(f"no CUDA kernels for torchgraft::topk_sigmoid: {native.build_info()}")


def _generator() -> tuple[torch.Generator, int]:
    """A generator with a fresh seed (reported by the assertions that use it)."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator(device="cuda").manual_seed(seed), seed


def _grid(shape: tuple[int, ...], step: float, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Random values on a grid of ``step``: equal ones tie exactly in every precision, unequal
    ones lie far apart next to float32 rounding (so the choice compares exactly)."""
    values = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64) * scale
    return (values / step).round() * step


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks: outputs a kernel forgets to write
    then read back as NaN (indices as huge values) instead of stale data."""
    torch.empty(nbytes // 4 + 1024, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm())


def _calls(op: str) -> int:
    return stats()[f"native/torchgraft::{op}/CUDA"]["calls"]


def _route(logits, bias, k, groups, topk_groups, renormalize, scale):
    return tgf.topk_sigmoid(
        logits, k, bias=bias, groups=groups, topk_groups=topk_groups,
        renormalize=renormalize, scale=scale,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("with_bias", "renormalize", "scale"),
    [(False, False, 1.0), (True, True, 2.5), (True, False, 1.0)],
    ids=["plain", "bias-renormalized-scaled", "bias"],
)
@pytest.mark.parametrize(("tokens", "experts", "k", "groups", "topk_groups"), SHAPES)
def test_cuda_matches_float64(
    dtype, with_bias, renormalize, scale, tokens, experts, k, groups, topk_groups
):
    gen, seed = _generator()
    logits = _grid((tokens, experts), 1 / 16, 2.0, gen).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    bias = _grid((experts,), 1 / 8, 0.5, gen).to(acc) if with_bias else None
    _poison_allocator(tokens * max(experts, k) * 16)
    before = _calls("topk_sigmoid")
    weights, indices = _route(logits, bias, k, groups, topk_groups, renormalize, scale)
    assert _calls("topk_sigmoid") == before + 1
    b64 = None if bias is None else bias.double()
    want_w, want_i = topk_sigmoid_reference(
        logits.double(), b64, k, groups, topk_groups, renormalize, scale
    )
    assert weights.dtype == acc and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (tokens, k) and weights.is_cuda and indices.is_cuda
    assert torch.isfinite(weights).all(), f"seed {seed}"
    differ = (indices != want_i).any(dim=-1)
    assert differ.float().mean() <= 1e-3, f"seed {seed}: {int(differ.sum())} tokens"
    if differ.any():
        _assert_near_ties(logits.double()[differ], b64, indices[differ], groups, topk_groups)
    # The weights of the experts the kernel chose, in float64.
    chosen_w = logits.double().sigmoid().gather(-1, indices)
    if renormalize:
        chosen_w = chosen_w / (chosen_w.sum(-1, keepdim=True) + 1e-20)
    assert _rel(weights, chosen_w * scale) <= TOL[dtype], f"seed {seed}"
    assert _rel(weights[~differ], want_w[~differ]) <= TOL[dtype], f"seed {seed}"


def _assert_near_ties(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    indices: torch.Tensor,
    groups: int,
    topk_groups: int,
) -> None:
    """Where the kernel's choice differs from the float64 reference's, it must be one the
    float64 values tie on within float32 rounding (top-2 sums of many groups near 2.0 come that
    close): every chosen expert's group within a few ulps of the ``topk_groups``-th best group
    score; no expert of a group that beats that score clearly, beating the chosen experts
    clearly, left out; the chosen experts largest first, up to a few ulps."""
    slack = 1e-6
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    size = choice.shape[-1] // groups
    group_scores = choice.unflatten(-1, (groups, size)).topk(2, dim=-1).values.sum(-1)
    cut = group_scores.topk(topk_groups, dim=-1).values[:, -1:]
    assert (group_scores.gather(-1, indices // size) >= cut - slack).all()
    picked = choice.gather(-1, indices)
    assert (picked[:, 1:] <= picked[:, :-1] + slack).all()
    surely_kept = (group_scores > cut + slack).repeat_interleave(size, dim=-1)
    must = surely_kept & (choice > picked.min(dim=-1, keepdim=True).values + slack)
    chosen = torch.zeros_like(must).scatter_(-1, indices, True)
    assert not (must & ~chosen).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("tokens", "experts", "k", "groups", "topk_groups"),
    [(64, 8, 8, 1, 1), (300, 64, 8, 8, 4), (50, 256, 32, 8, 4), (9, 600, 40, 6, 2)],
)
def test_cuda_ties_and_nan_go_as_on_the_cpu(dtype, tokens, experts, k, groups, topk_groups):
    """Equal logits (multiples of 0.5 in [-2, 2]: every row has many) give the lower expert and
    the lower group first; a NaN logit is chosen first with a NaN weight. The CPU kernel's
    experts exactly, its weights within rounding (NaN where it has NaN)."""
    gen, seed = _generator()
    logits = (torch.randint(-4, 5, (tokens, experts), generator=gen, device="cuda") / 2).to(dtype)
    logits[0, experts // 2] = float("nan")
    logits[1, -1] = float("inf")
    logits[2] = float("-inf")
    _poison_allocator(tokens * experts * 16)
    weights, indices = _route(logits, None, k, groups, topk_groups, True, 1.0)
    cpu_w, cpu_i = _route(logits.cpu(), None, k, groups, topk_groups, True, 1.0)
    assert torch.equal(indices.cpu(), cpu_i), f"seed {seed}"
    assert weights[0].isnan().all()
    torch.testing.assert_close(weights.cpu(), cpu_w, rtol=TOL[dtype], atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["scores", "renormalized"])
@pytest.mark.parametrize(
    ("tokens", "experts", "k", "groups", "topk_groups"),
    [(37, 8, 2, 1, 1), (513, 64, 8, 8, 4), (64, 256, 8, 8, 4), (11, 700, 35, 7, 3)],
)
def test_cuda_gradients_match_float64(dtype, renormalize, tokens, experts, k, groups, topk_groups):
    gen, seed = _generator()
    logits = _grid((tokens, experts), 1 / 16, 2.0, gen).to(dtype).requires_grad_()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    bias = _grid((experts,), 1 / 8, 0.5, gen).to(acc)
    grad = torch.randn(tokens, k, generator=gen, device="cuda", dtype=torch.float64)
    _poison_allocator(tokens * experts * 16)
    before = _calls("topk_sigmoid_backward")
    _route(logits, bias, k, groups, topk_groups, renormalize, 2.5)[0].backward(grad.to(acc))
    assert _calls("topk_sigmoid_backward") == before + 1
    x64 = logits.detach().double().requires_grad_()
    want = topk_sigmoid_reference(x64, bias.double(), k, groups, topk_groups, renormalize, 2.5)
    want[0].backward(grad)
    assert logits.grad.dtype == dtype and logits.grad.shape == logits.shape
    assert torch.isfinite(logits.grad).all(), f"seed {seed}"
    assert _rel(logits.grad, x64.grad) <= GRAD_TOL[dtype], f"seed {seed}"
    # Only the selected logits get a gradient.
    chosen = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    chosen.scatter_(1, want[1], True)
    assert (logits.grad[~chosen] == 0).all()


def test_cuda_gradcheck_float64():
    logits = torch.randn(9, 40, dtype=torch.float64, device="cuda", requires_grad=True)
    bias = torch.randn(40, dtype=torch.float64, device="cuda") * 0.2
    for renormalize in (False, True):
        assert torch.autograd.gradcheck(
            lambda x: _route(x, bias, 5, 4, 2, renormalize, 2.5)[0],  # noqa: B023
            (logits,),
        )


def test_cuda_runs_the_native_kernels_on_the_current_stream():
    reset_stats()
    logits = torch.randn(8192, 256, device="cuda", requires_grad=True)
    bias = torch.randn(256, device="cuda") * 0.1
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        weights, indices = _route(logits, bias, 8, 8, 4, True, 2.5)
        weights.sum().backward()
    stream.synchronize()
    want_w, want_i = topk_sigmoid_reference(
        logits.detach().double(), bias.double(), 8, 8, 4, True, 2.5
    )
    assert (indices == want_i).float().mean() > 0.999  # random logits: a rare float32 near-tie
    assert _rel(weights, want_w) <= 1e-3
    got = stats()
    assert got["native/torchgraft::topk_sigmoid/CUDA"]["calls"] == 1
    assert got["native/torchgraft::topk_sigmoid_backward/CUDA"]["calls"] == 1


def test_cuda_takes_strided_and_empty_logits():
    gen, _ = _generator()
    logits = _grid((64, 50), 1 / 16, 2.0, gen).float().t()  # (50 tokens, 64 experts), strided
    weights, indices = _route(logits, None, 4, 8, 2, False, 1.0)
    want_w, want_i = topk_sigmoid_reference(logits.double(), None, 4, 8, 2, False, 1.0)
    assert torch.equal(indices, want_i) and _rel(weights, want_w) <= TOL[torch.float32]
    empty = torch.randn(0, 16, device="cuda", requires_grad=True)
    weights, indices = _route(empty, None, 2, 4, 2, True, 1.0)
    assert weights.shape == indices.shape == (0, 2)
    weights.sum().backward()
    assert empty.grad.shape == (0, 16)


def test_cuda_errors_are_the_cpus():
    logits = torch.randn(4, 6, device="cuda")
    op = torch.ops.torchgraft.topk_sigmoid
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        op(logits, None, 5, 3, 2, False, 1.0)
    with pytest.raises(RuntimeError, match="groups of at least 2"):
        op(logits, None, 1, 4, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="same device"):
        op(logits, torch.randn(6), 1, 1, 1, False, 1.0)  # a bias on the CPU: ATen's error
