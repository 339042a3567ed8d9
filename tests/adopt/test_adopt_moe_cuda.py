"""torchgraft.adopt on the GPU for MoE models: every family the MoE adopters take (Qwen3-MoE,
OLMoE, Mixtral, GPT-OSS's experts with biases, DeepSeek-V3's and GLM-4-MoE's sigmoid routers)
trains like stock on CUDA, with the CUDA kernels of the routing and the permutation running."""

from __future__ import annotations

import copy

import pytest
import torch

import torchgraft
from adopt_helpers import tiny_moe_model

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]
pytest.importorskip("transformers")

VOCAB = 96
FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe"]
ROUTING_OP = {"deepseek_v3": "topk_sigmoid", "glm4_moe": "topk_sigmoid", "gpt_oss": None}
LOSS_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GRAD_TOLERANCE = 1e-4
"""float32: the adopted step's gradients against stock's. bfloat16 rounds each path its own way:
both are measured against the float32 step, and the adopted one may be off by at most twice as
much as stock (or 2e-2)."""


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_model_trains_like_stock_on_cuda(family: str, dtype: torch.dtype) -> None:
    exact = tiny_moe_model(family).cuda()
    stock, model = copy.deepcopy(exact).to(dtype), copy.deepcopy(exact).to(dtype)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    want_loss, want_grads = _step(exact, ids)
    _, stock_grads = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        kinds = {r.kind for r in report.rows if r.status == "adopted"}
        assert "moe_experts" in kinds, report.table(False)
        routing = ROUTING_OP.get(family, "topk_softmax")
        if routing is not None:
            assert "moe_router" in kinds, report.table(False)
        torchgraft.reset_stats()
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
        torch.cuda.synchronize()
        stats = torchgraft.stats()
    finally:
        torchgraft.unadopt(model)
    assert stats["native/torchgraft::moe_permute/CUDA"]["calls"] >= 4
    assert stats["native/torchgraft::moe_unpermute_backward/CUDA"]["calls"] >= 2
    if routing is not None:
        assert stats[f"native/torchgraft::{routing}/CUDA"]["calls"] == 2
        assert stats[f"native/torchgraft::{routing}_backward/CUDA"]["calls"] == 2
    assert _rel(loss, want_loss) < LOSS_TOLERANCE[dtype]
    assert len(grads) == len(want_grads) == len(stock_grads)
    for got, theirs, want in zip(grads, stock_grads, want_grads, strict=True):
        if dtype == torch.float32:
            assert _rel(got, want) < GRAD_TOLERANCE
        else:
            assert _rel(got, want) <= max(2 * _rel(theirs, want), 2e-2)
