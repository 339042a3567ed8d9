"""The MoE load-balancing loss adopter: transformers' ``load_balancing_loss_func`` counts the
experts without ``bincount`` (no host sync on CUDA), and a training step equals stock's."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchgraft
from adopt_helpers import MOE_COMMON, MOE_FAMILIES, tiny_moe_model
from torchgraft.adopt.report import ADOPTED, SKIPPED

pytestmark = pytest.mark.default_torch
pytest.importorskip("transformers")


class _Bincounts(TorchDispatchMode):
    """Counts ``aten::bincount`` calls (each one syncs with the host on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.bincount.default
        return func(*args, **(kwargs or {}))


def _rows(report):
    return [r for r in report.rows if r.kind == "moe_balance_loss"]


def _ids(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MOE_COMMON["vocab_size"], (2, 12), generator=gen)


def _step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    with _Bincounts() as seen:
        out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
        out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out.loss.detach(), out.aux_loss.detach(), grads, seen.calls


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_training_step_equals_stock_without_bincount(family):
    stock, model = tiny_moe_model(family), tiny_moe_model(family)
    ids = torch.randint(
        0, MOE_COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4)
    )
    want = _step(stock, ids)
    assert want[3] == MOE_COMMON["num_hidden_layers"]  # stock: one bincount per layer
    pymod = sys.modules[type(model).__module__]
    own = pymod.load_balancing_loss_func
    report = torchgraft.adopt(model)
    try:
        (row,) = _rows(report)
        assert (row.status, row.route) == (
            ADOPTED,
            "expert counts without a host sync -> aten::scatter_add",
        ), row.reason
        with torchgraft.enabled():
            got = _step(model, ids)
        assert got[3] == 0
        assert _step(model, ids)[3] == MOE_COMMON["num_hidden_layers"]  # disabled: the own one
    finally:
        torchgraft.unadopt(model)
    assert pymod.load_balancing_loss_func is own
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    assert len(got[2]) == len(want[2])
    for g, w in zip(got[2], want[2], strict=True):
        assert float((g - w).norm() / w.norm().clamp_min(1e-12)) < 1e-4


def test_padding_mask_runs_the_models_own_branch():
    stock, model = tiny_moe_model("qwen3_moe"), tiny_moe_model("qwen3_moe")
    ids = torch.randint(
        0, MOE_COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5)
    )
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = _step(stock, ids, attention_mask=mask)
    torchgraft.adopt(model)
    try:
        with torchgraft.enabled():
            got = _step(model, ids, attention_mask=mask)
    finally:
        torchgraft.unadopt(model)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)


def test_another_signature_is_left_alone(monkeypatch):
    model = tiny_moe_model("olmoe")
    pymod = sys.modules[type(model).__module__]

    def load_balancing_loss_func(gate_logits, num_experts, top_k=2, attention_mask=None, *, z=0.0):
        return 0

    monkeypatch.setattr(pymod, "load_balancing_loss_func", load_balancing_loss_func)
    report = torchgraft.adopt(model)
    torchgraft.unadopt(model)
    (row,) = _rows(report)
    assert row.status == SKIPPED and "signature" in row.reason, row.reason
    assert pymod.load_balancing_loss_func is load_balancing_loss_func
