"""torchgraft.functional.topk_softmax (MoE routing): the CPU kernel against float64, gradients
by gradcheck, transformers' router numerics, ties, errors, torch.compile."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from torchgraft import functional as tgf
from torchgraft.ops.topk_softmax.reference import topk_softmax_reference

pytestmark = pytest.mark.default_torch

TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-6, torch.float16: 1e-6}
"""Relative error of the weights: computed in float32 from the given logits, whatever their
dtype (the logits are exact in float32)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _calls(op: str) -> int:
    return torchgraft.stats()[f"native/torchgraft::{op}/CPU"]["calls"]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 1, 1), (37, 8, 2), (129, 64, 8)])
def test_matches_float64(dtype, renormalize, tokens, experts, k):
    logits = (torch.randn(tokens, experts) * 3).to(dtype)
    before = _calls("topk_softmax")
    weights, indices = tgf.topk_softmax(logits, k, renormalize=renormalize)
    assert _calls("topk_softmax") == before + 1
    want_w, want_i = topk_softmax_reference(logits.double(), k, renormalize)
    assert weights.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert indices.dtype == torch.int64 and weights.shape == indices.shape == (tokens, k)
    assert torch.equal(indices, want_i)
    assert _rel(weights, want_w) <= TOL[dtype]


@pytest.mark.parametrize("renormalize", [False, True])
def test_gradients_by_gradcheck(renormalize):
    logits = torch.randn(9, 12, dtype=torch.float64, requires_grad=True)
    before = _calls("topk_softmax_backward")
    assert torch.autograd.gradcheck(
        lambda x: tgf.topk_softmax(x, 3, renormalize=renormalize)[0], (logits,)
    )
    assert _calls("topk_softmax_backward") > before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_matches_float64(dtype):
    logits = (torch.randn(64, 32) * 2).to(dtype)
    grad = torch.randn(64, 4)
    for renormalize in (False, True):
        x = logits.clone().requires_grad_()
        tgf.topk_softmax(x, 4, renormalize=renormalize)[0].backward(grad)
        x64 = logits.double().requires_grad_()
        topk_softmax_reference(x64, 4, renormalize)[0].backward(grad.double())
        assert x.grad.dtype == dtype
        assert _rel(x.grad, x64.grad) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_is_what_transformers_qwen3_moe_router_computes():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True
    )
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(2, 10, 32)
    logits, scores, indices = router(hidden)
    weights, ours = tgf.topk_softmax(logits, 4, renormalize=True)
    assert torch.equal(ours, indices)
    assert _rel(weights.to(logits.dtype), scores) <= 1e-6


def test_ties_take_the_lower_expert_first():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    _, indices = tgf.topk_softmax(logits, 4)
    assert indices.tolist() == [[1, 2, 4, 0]]
    assert torch.equal(indices, topk_softmax_reference(logits, 4, False)[1])


def test_errors_are_torchs():
    logits = torch.randn(4, 6)
    for k in (0, 7):
        with pytest.raises(RuntimeError, match="selected index k out of range"):
            torch.ops.torchgraft.topk_softmax(logits, k, False)
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        tgf.topk_softmax(logits, 7)
    with pytest.raises(RuntimeError, match="expected logits to have 2 dimensions, got 1"):
        torch.ops.torchgraft.topk_softmax(torch.randn(6), 1, False)
    # Other shapes go to torch's ops: any leading dims.
    weights, indices = tgf.topk_softmax(torch.randn(2, 3, 6), 2)
    assert weights.shape == indices.shape == (2, 3, 2)


def test_compiles_fullgraph_and_matches_eager():
    logits = torch.randn(16, 8, requires_grad=True)
    grad = torch.randn(16, 2)

    def route(x: torch.Tensor) -> torch.Tensor:
        return tgf.topk_softmax(x, 2, renormalize=True)[0]

    compiled = torch.compile(route, backend="aot_eager", fullgraph=True)
    out = compiled(logits)
    (g,) = torch.autograd.grad(out, logits, grad)
    ref = route(logits)
    (g_ref,) = torch.autograd.grad(ref, logits, grad)
    assert torch.equal(out, ref) and torch.equal(g, g_ref)
