"""torchgraft.functional.topk_sigmoid (sigmoid group-limited MoE routing): the CPU kernel
against float64, gradients by gradcheck, transformers' DeepSeek-V3 and GLM-4-MoE routers'
numerics, ties, errors, fallbacks, torch.compile."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from torchgraft import functional as tgf
from torchgraft.ops.topk_sigmoid.reference import topk_sigmoid_reference

pytestmark = pytest.mark.default_torch

TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-6, torch.float16: 1e-6}
"""Relative error of the weights: computed in float32 from the given logits, whatever their
dtype (the logits are exact in float32)."""

# (tokens, experts, k, groups, topk_groups)
SHAPES = [
    (1, 2, 1, 1, 1),
    (37, 8, 2, 1, 1),
    (129, 64, 8, 8, 4),
    (20, 256, 8, 8, 4),
    (5, 12, 5, 3, 2),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _calls(op: str) -> int:
    return torchgraft.stats()[f"native/torchgraft::{op}/CPU"]["calls"]


def _logits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random logits on a grid of 1/16: equal ones tie exactly in every precision, unequal
    ones are far apart next to float32 rounding (so the choice compares exactly)."""
    return ((torch.randn(shape) * 32).round() / 16).to(dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    ("renormalize", "scale", "with_bias"), [(False, 1.0, False), (True, 2.5, True)]
)
@pytest.mark.parametrize(("tokens", "experts", "k", "groups", "topk_groups"), SHAPES)
def test_matches_float64(
    dtype, renormalize, scale, with_bias, tokens, experts, k, groups, topk_groups
):
    logits = _logits((tokens, experts), dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    bias = (torch.randn(experts) * 4).round().div(16).to(acc) if with_bias else None
    before = _calls("topk_sigmoid")
    weights, indices = tgf.topk_sigmoid(
        logits, k, bias=bias, groups=groups, topk_groups=topk_groups,
        renormalize=renormalize, scale=scale,
    )  # fmt: skip
    assert _calls("topk_sigmoid") == before + 1
    want_w, want_i = topk_sigmoid_reference(
        logits.double(), None if bias is None else bias.double(), k, groups, topk_groups,
        renormalize, scale,
    )  # fmt: skip
    assert weights.dtype == acc
    assert indices.dtype == torch.int64 and weights.shape == indices.shape == (tokens, k)
    assert torch.equal(indices, want_i)
    assert _rel(weights, want_w) <= TOL[dtype]


@pytest.mark.parametrize("renormalize", [False, True])
def test_gradients_by_gradcheck(renormalize):
    logits = torch.randn(9, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64) * 0.2
    before = _calls("topk_sigmoid_backward")

    def route(x: torch.Tensor) -> torch.Tensor:
        return tgf.topk_sigmoid(
            x, 3, bias=bias, groups=3, topk_groups=2, renormalize=renormalize, scale=2.5
        )[0]

    assert torch.autograd.gradcheck(route, (logits,))
    assert _calls("topk_sigmoid_backward") > before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_matches_float64(dtype):
    logits = _logits((64, 32), dtype)
    grad = torch.randn(64, 4)
    for renormalize in (False, True):
        x = logits.clone().requires_grad_()
        tgf.topk_sigmoid(x, 4, groups=4, topk_groups=2, renormalize=renormalize)[0].backward(grad)
        x64 = logits.double().requires_grad_()
        topk_sigmoid_reference(x64, None, 4, 4, 2, renormalize, 1.0)[0].backward(grad.double())
        assert x.grad.dtype == dtype
        assert _rel(x.grad, x64.grad) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


def _router(family: str, experts: int, k: int, groups: int, topk_groups: int):
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=32, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
        topk_group=topk_groups, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(**common)
        module = transformers.models.deepseek_v3.modeling_deepseek_v3
        router = module.DeepseekV3TopkRouter(config)
    else:
        config = transformers.Glm4MoeConfig(**common)
        module = transformers.models.glm4_moe.modeling_glm4_moe
        router = module.Glm4MoeTopkRouter(config)
    torch.nn.init.normal_(router.weight)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(std=0.2)
    return router


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_is_what_transformers_sigmoid_routers_compute(family):
    router = _router(family, experts=16, k=4, groups=4, topk_groups=2)
    hidden = torch.randn(2, 10, 32)
    logits, scores, indices = router(hidden)
    weights, ours = tgf.topk_sigmoid(
        logits, 4, bias=router.e_score_correction_bias, groups=4, topk_groups=2,
        renormalize=True, scale=2.5,
    )  # fmt: skip
    # The routers take topk(sorted=False): compare each token's experts as a set.
    got, want = ours.sort(dim=-1), indices.sort(dim=-1)
    assert torch.equal(got.values, want.values)
    assert _rel(weights.gather(-1, got.indices), scores.gather(-1, want.indices)) <= 1e-6


def test_the_group_limit_and_the_bias_decide_the_choice():
    # Scores 0.9, 0.1 | 0.8, 0.7 | 0.6, 0.6: expert 0 is the best but its group is not.
    p = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.6, 0.6]], dtype=torch.float64)
    logits = torch.log(p / (1 - p))
    _, indices = tgf.topk_sigmoid(logits, 3, groups=3, topk_groups=2)
    assert indices.tolist() == [[2, 3, 4]]  # ties: the lower expert first
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.3], dtype=torch.float64)
    weights, indices = tgf.topk_sigmoid(logits, 3, bias=bias, groups=3, topk_groups=2)
    assert indices.tolist() == [[5, 2, 3]]  # the bias steers the choice...
    assert torch.allclose(weights, p[:, [5, 2, 3]])  # ...and not the weights


def test_errors():
    logits = torch.randn(4, 6)
    op = torch.ops.torchgraft.topk_sigmoid
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        op(logits, None, 0, 1, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        op(logits, None, 5, 3, 2, False, 1.0)  # 2 groups of 2 kept: 4 experts
    with pytest.raises(RuntimeError, match="groups of at least 2"):
        op(logits, None, 1, 4, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="groups of at least 2"):
        op(logits, None, 1, 6, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="topk_groups"):
        op(logits, None, 1, 3, 4, False, 1.0)
    with pytest.raises(RuntimeError, match="expected logits to have 2 dimensions, got 1"):
        op(torch.randn(6), None, 1, 1, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="bias"):
        op(logits, torch.randn(6, dtype=torch.float64), 1, 1, 1, False, 1.0)
    with pytest.raises(RuntimeError, match="bias"):
        op(logits, torch.randn(5), 1, 1, 1, False, 1.0)


def test_the_face_computes_what_the_kernels_do_not_take_with_torchs_ops():
    logits = torch.randn(4, 6)
    before = _calls("topk_sigmoid")
    # k beyond the kept groups: torch's ops choose among the left-out experts too.
    weights, indices = tgf.topk_sigmoid(logits, 5, groups=3, topk_groups=2)
    assert weights.shape == indices.shape == (4, 5)
    # Any leading dims, and a bfloat16 bias on the kernel (widened exactly).
    assert tgf.topk_sigmoid(torch.randn(2, 3, 6), 2)[0].shape == (2, 3, 2)
    assert _calls("topk_sigmoid") == before
    bias = torch.randn(6).bfloat16()
    weights, indices = tgf.topk_sigmoid(logits, 2, bias=bias)
    want_w, want_i = topk_sigmoid_reference(logits, bias.float(), 2, 1, 1, False, 1.0)
    assert _calls("topk_sigmoid") == before + 1
    assert torch.equal(indices, want_i) and _rel(weights, want_w) <= 1e-6
    # Groups that do not split the experts: torch's error.
    with pytest.raises(RuntimeError):
        tgf.topk_sigmoid(logits, 1, groups=4)


def test_compiles_fullgraph_and_matches_eager():
    logits = torch.randn(16, 8, requires_grad=True)
    bias = torch.randn(8) * 0.2
    grad = torch.randn(16, 2)

    def route(x: torch.Tensor) -> torch.Tensor:
        return tgf.topk_sigmoid(x, 2, bias=bias, groups=4, topk_groups=2, renormalize=True)[0]

    compiled = torch.compile(route, backend="aot_eager", fullgraph=True)
    out = compiled(logits)
    (g,) = torch.autograd.grad(out, logits, grad)
    ref = route(logits)
    (g_ref,) = torch.autograd.grad(ref, logits, grad)
    assert torch.equal(out, ref) and torch.equal(g, g_ref)
