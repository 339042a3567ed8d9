"""The causal-LM head adopter: training with labels runs the fused linear cross-entropy (no
logits), equal to the model's own loss and gradients; every other call is the model's own."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchgraft
from adopt_helpers import (
    MOE_COMMON,
    VOCAB,
    batch,
    enabled_throughout,
    instance_forwards,
    rel_err,
    tiny_model,
    tiny_moe_model,
    train_step,
)
from torchgraft import native
from torchgraft.adopt.report import ADOPTED, SKIPPED

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]


@pytest.fixture(autouse=True)
def _enabled():
    # Adopted layers run torchgraft's operators only while it is enabled.
    with enabled_throughout():
        yield


def _head_row(report):
    (row,) = [r for r in report.rows if r.kind == "causal_lm_head"]
    return row


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_training_step_equals_the_model_and_unadopt_restores(family):
    model = tiny_model(family)
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    report = torchgraft.adopt(model)
    row = _head_row(report)
    assert (row.status, row.route) == (
        ADOPTED,
        "fused head + loss -> torchgraft::linear_cross_entropy",
    ), report.table(False)
    torchgraft.reset_stats()
    step = train_step(model, ids, labels)
    assert step.logits is None  # the fused path computes none
    assert torchgraft.stats()["native/torchgraft::linear_cross_entropy/CPU"]["calls"] == 1
    assert abs(float(step.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
    assert step.grads.keys() == ref.grads.keys()
    for name, grad in ref.grads.items():
        assert rel_err(step.grads[name], grad) <= 1e-4, name
    # Evaluation, and training without labels, run the model's own forward: logits as before.
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (*ids.shape, VOCAB)
    assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
    model.train()
    assert model(input_ids=ids).logits.shape == (*ids.shape, VOCAB)
    torchgraft.unadopt(model)
    assert instance_forwards(model) == {}
    again = train_step(model, ids, labels)
    assert torch.equal(again.logits, ref.logits) and torch.equal(again.loss, ref.loss)


def test_gradient_accumulation_and_given_shift_labels():
    model = tiny_model("llama")
    ids, labels = batch()
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    kwargs = [{"num_items_in_batch": torch.tensor(9)}, {"shift_labels": shift}]
    refs = [model(input_ids=ids, labels=labels, **kw).loss.detach() for kw in kwargs]
    assert _head_row(torchgraft.adopt(model)).status == ADOPTED
    for kw, ref in zip(kwargs, refs, strict=True):
        out = model(input_ids=ids, labels=labels, **kw)
        assert out.logits is None
        assert abs(float(out.loss) - float(ref)) <= 1e-5 * abs(float(ref))
    torchgraft.unadopt(model)


class _LargestVocabTensor(TorchDispatchMode):
    """The largest tensor with a last dimension of the vocabulary size that an op returns (as
    seen from Python: the model's own ops and torchgraft's op)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


def test_the_full_logits_never_exist():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 1024), generator=gen)  # 2048 tokens: two 1024-row chunks
    tokens = ids.numel()
    with _LargestVocabTensor() as own:
        model(input_ids=ids, labels=ids).loss.backward()
    assert own.largest >= tokens * VOCAB
    torchgraft.adopt(model)
    with _LargestVocabTensor() as fused:
        model(input_ids=ids, labels=ids).loss.backward()
    assert fused.largest < tokens * VOCAB
    torchgraft.unadopt(model)


def test_skipped_where_it_could_differ():
    model = tiny_model("llama")
    handle = model.lm_head.register_forward_hook(lambda *a: None)
    row = _head_row(torchgraft.adopt(model))
    assert row.status == SKIPPED and "hooks" in row.reason
    handle.remove()
    torchgraft.unadopt(model)
    gemma2 = tiny_model("gemma2")
    row = _head_row(torchgraft.adopt(gemma2))
    assert row.status == SKIPPED and "final_logit_softcapping" in row.reason
    torchgraft.unadopt(gemma2)


def test_compiled_adopted_model_trains():
    model = tiny_model("llama")
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    torchgraft.adopt(model)
    compiled = torch.compile(model, backend="aot_eager")
    step = train_step(compiled, ids, labels)
    assert abs(float(step.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
    for name, grad in ref.grads.items():
        assert rel_err(step.grads[name], grad) <= 1e-4, name
    torchgraft.unadopt(model)


def _moe_step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    aux = None if out.aux_loss is None else out.aux_loss.detach()
    return out, aux, grads


@pytest.mark.parametrize(
    ("family", "config_router_logits"),
    [("qwen3_moe", True), ("qwen3_moe", False), ("olmoe", True), ("mixtral", False)],
)
def test_moe_loss_keeps_the_router_loss(family, config_router_logits):
    """MoE models add the routers' load-balancing loss to the loss, when their config or the
    call asks for it (reading the attention mask): the fused path adds the same."""
    stock = tiny_moe_model(family, output_router_logits=config_router_logits)
    model = tiny_moe_model(family, output_router_logits=config_router_logits)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MOE_COMMON["vocab_size"], (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    calls = [{}, {"output_router_logits": True, "attention_mask": mask}]
    refs = [_moe_step(stock, ids, **kw) for kw in calls]
    row = _head_row(torchgraft.adopt(model))
    try:
        assert (row.status, row.route) == (
            ADOPTED,
            "fused head + loss + router loss -> torchgraft::linear_cross_entropy",
        ), row.reason
        for kw, (ref, ref_aux, ref_grads) in zip(calls, refs, strict=True):
            out, aux, grads = _moe_step(model, ids, **kw)
            assert out.logits is None
            assert (aux is None) == (ref_aux is None) == (not (config_router_logits or kw))
            if aux is not None:
                assert abs(float(aux) - float(ref_aux)) <= 1e-6 * abs(float(ref_aux))
            assert abs(float(out.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
            assert grads.keys() == ref_grads.keys()
            for name, grad in ref_grads.items():
                assert rel_err(grads[name], grad) <= 1e-4, name
    finally:
        torchgraft.unadopt(model)


def test_moe_router_loss_of_another_kind_is_skipped():
    """A forward that takes ``output_router_logits`` but adds its router loss otherwise than
    transformers' ``load_balancing_loss_func`` keeps its own head."""
    model = tiny_moe_model("qwen3_moe")
    parent = type(model)

    class OwnRouterLoss(parent):  # its forward's globals (this file) have no such function
        def forward(self, *args, output_router_logits=None, **kwargs):
            return parent.forward(self, *args, output_router_logits=output_router_logits, **kwargs)

    model.__class__ = OwnRouterLoss
    row = _head_row(torchgraft.adopt(model))
    torchgraft.unadopt(model)
    assert row.status == SKIPPED and "load_balancing_loss_func" in row.reason, row.reason
