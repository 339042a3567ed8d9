"""The MoE router adopter: transformers' top-k routers (Qwen3-MoE, OLMoE, Mixtral) run
torchgraft.functional.topk_softmax with their own numerics, and a training step (the router's
load-balancing loss included) equals the same model's without torchgraft."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from adopt_helpers import MOE_COMMON, tiny_moe_model

pytestmark = pytest.mark.default_torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = MOE_COMMON
FAMILIES = {
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **COMMON, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True
        ),
        "norm_topk_prob",
    ),
    "qwen3_moe, no renormalization": (
        lambda: transformers.Qwen3MoeConfig(
            **COMMON, moe_intermediate_size=16, num_experts=8, norm_topk_prob=False
        ),
        "norm_topk_prob",
    ),
    "olmoe": (lambda: transformers.OlmoeConfig(**COMMON, num_experts=8), "norm_topk_prob"),
    "mixtral": (
        lambda: transformers.MixtralConfig(**COMMON, num_local_experts=8),
        "always renormalized",
    ),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]())
    for module in model.modules():  # the routers start at zeros: every expert would tie
        if type(module).__name__.endswith("TopKRouter"):
            torch.nn.init.normal_(module.weight, std=0.5)
    return model.train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert out.aux_loss is not None  # the load-balancing loss is part of the loss
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routers_are_adopted_and_train_like_stock(family: str) -> None:
    stock, model = _model(family), _model(family)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        rows = [r for r in report.rows if r.kind == "moe_router"]
        assert len(rows) == 2 and all(r.status == "adopted" for r in rows), rows
        assert all(r.route.startswith(FAMILIES[family][1]) for r in rows), rows
        torchgraft.reset_stats()
        with torchgraft.enabled():
            got = _step(model, ids)
        stats = torchgraft.stats()
        assert stats["native/torchgraft::topk_softmax/CPU"]["calls"] == 2
        assert stats["native/torchgraft::topk_softmax_backward/CPU"]["calls"] == 2
    finally:
        torchgraft.unadopt(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        assert float((g - w).norm() / w.norm().clamp_min(1e-12)) < 1e-4


class SigmoidRouter(torch.nn.Module):
    """A router the adopter finds by structure but whose numerics (sigmoid scores) differ."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.hidden_dim, self.norm_topk_prob = 2, 16, True
        self.weight = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, 16), self.weight)
        scores, indices = torch.topk(torch.sigmoid(logits.float()), self.top_k, dim=-1)
        return logits, (scores / scores.sum(-1, keepdim=True)).to(logits.dtype), indices


def test_a_router_with_other_numerics_is_skipped() -> None:
    router = SigmoidRouter()
    report = torchgraft.adopt(router)
    try:
        (row,) = [r for r in report.rows if r.kind == "moe_router"]
        assert row.status == "skipped" and "no variant matches" in row.reason, row
        assert "forward" not in router.__dict__
    finally:
        torchgraft.unadopt(router)


SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")


def _sigmoid_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", SIGMOID_FAMILIES)
def test_sigmoid_routers_are_adopted_and_train_like_stock(family: str) -> None:
    """DeepSeek-V3 (MLA attention) and GLM-4-MoE: 8 experts in 4 groups, 2 kept, a correction
    bias, weights x 2.5, a shared expert, every layer MoE."""
    stock, model = tiny_moe_model(family), tiny_moe_model(family)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = _sigmoid_step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        rows = [r for r in report.rows if r.kind == "moe_router"]
        assert len(rows) == 2 and all(r.status == "adopted" for r in rows), rows
        assert all(r.route.startswith("sigmoid scores, group-limited") for r in rows), rows
        experts = [r for r in report.rows if r.kind == "moe_experts"]
        assert len(experts) == 2 and all(r.status == "adopted" for r in experts), experts
        torchgraft.reset_stats()
        with torchgraft.enabled():
            got = _sigmoid_step(model, ids)
        stats = torchgraft.stats()
        assert stats["native/torchgraft::topk_sigmoid/CPU"]["calls"] == 2
        assert stats["native/torchgraft::topk_sigmoid_backward/CPU"]["calls"] == 2
    finally:
        torchgraft.unadopt(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        assert float((g - w).norm() / w.norm().clamp_min(1e-12)) < 1e-4


def test_a_sigmoid_router_that_ignores_its_bias_is_skipped() -> None:
    """The probe draws a correction bias: a router that chooses without it computes something
    else, though it has every field of the sigmoid routers."""
    model = tiny_moe_model("deepseek_v3")
    router = model.model.layers[0].mlp.gate
    plain = type(router).forward

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple:
        saved = self.e_score_correction_bias
        self._buffers["e_score_correction_bias"] = torch.zeros_like(saved)
        try:
            return plain(self, hidden_states)
        finally:
            self._buffers["e_score_correction_bias"] = saved

    router.forward = forward.__get__(router)
    report = torchgraft.adopt(router)
    try:
        (row,) = [r for r in report.rows if r.kind == "moe_router"]
        assert row.status == "skipped" and "does not match" in row.reason, row
    finally:
        torchgraft.unadopt(router)
