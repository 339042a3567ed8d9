"""The causal-mask adopter: a compiled adopted model's SDPA calls take ``is_causal`` instead of a
materialized mask, as eager calls do, and compute the same loss and gradients; nothing changes
for export, padding masks, sliding windows, or while torchgraft is off."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from adopt_helpers import SdpaCalls
from torchgraft.adopt import causal_mask

pytestmark = pytest.mark.compat

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")


def _llama(attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def adopted():
    model = _llama()
    report = torchgraft.adopt(model)
    yield model, report
    torchgraft.unadopt(model)
    torchgraft.disable()
    torch._dynamo.reset()


def _row(report, kind: str):
    return next(r for r in report.rows if r.kind == kind)


def test_adopted_for_sdpa_models_only(adopted):
    _, report = adopted
    assert _row(report, "causal_mask").status == "adopted"
    eager = _llama(attn="eager")
    try:
        rows = [r for r in torchgraft.adopt(eager).rows if r.kind == "causal_mask"]
        assert rows == []
    finally:
        torchgraft.unadopt(eager)


def test_compiled_sdpa_takes_is_causal_and_the_loss_and_gradients_are_stock(adopted):
    model, _ = adopted
    stock = _llama()
    ids = torch.randint(0, 96, (2, 12))
    ref = stock(input_ids=ids, labels=ids).loss
    ref.backward()

    backend = SdpaCalls()
    torchgraft.enable()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert backend.calls and all(call == (False, True) for call in backend.calls)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_while_torchgraft_is_off_the_compiled_model_builds_the_mask(adopted):
    model, _ = adopted
    ids = torch.randint(0, 96, (2, 12))
    backend = SdpaCalls()
    with torchgraft.disabled():
        torch.compile(model, backend=backend)(input_ids=ids)
    assert backend.calls and all(mask for mask, _ in backend.calls)


def test_a_padding_mask_is_still_materialized(adopted):
    model, _ = adopted
    ids = torch.randint(0, 96, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, :3] = 0
    backend = SdpaCalls()
    torchgraft.enable()
    torch.compile(model, backend=backend)(input_ids=ids, attention_mask=attention_mask)
    assert backend.calls and all(mask for mask, _ in backend.calls)


def test_export_keeps_the_mask(adopted):
    model, _ = adopted
    torchgraft.enable()
    ids = torch.randint(0, 96, (1, 8))
    kwargs = {"input_ids": ids, "use_cache": False}
    exported = torch.export.export(model.eval(), (), kwargs, strict=False)
    sdpa = [n for n in exported.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and all(n.args[3] is not None or n.kwargs.get("attn_mask") for n in sdpa)


@pytest.mark.parametrize(
    ("q_length", "kv_length", "q_offset", "window", "skips"),
    [
        (8, 8, 0, None, True),
        (4, 9, 0, None, True),
        (1, 9, 8, None, True),
        (8, 8, 0, 4, False),
        (8, 8, 0, 16, True),
    ],
)
def test_the_compile_rule_is_transformers_eager_rule(q_length, kv_length, q_offset, window, skips):
    own = masking_utils._ignore_causal_mask_sdpa
    assert causal_mask.skips_mask(q_length, kv_length, q_offset, window) is skips
    assert bool(own(None, q_length, kv_length, q_offset, 0, window)) is skips


def test_a_rule_that_is_not_transformers_is_not_adopted(monkeypatch):
    def never(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return False

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", never)
    model = _llama()
    try:
        row = _row(torchgraft.adopt(model), "causal_mask")
        assert row.status == "skipped"
        assert "transformers' own eager rule" in row.reason
        assert masking_utils._ignore_causal_mask_sdpa is never
    finally:
        torchgraft.unadopt(model)
