"""The default-positions adopter: where a base model derives its own positions (no position_ids,
mask or cache), transformers' packed-sequence check answers "not packed" without reading data,
so a compiled model's SDPA calls take ``is_causal`` and an eager one does not synchronize; every
call that passes positions keeps transformers' own check and mask."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from adopt_helpers import SdpaCalls
from torchgraft.adopt import default_positions

pytestmark = pytest.mark.compat

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
create_causal_mask = masking_utils.create_causal_mask  # read by the adopter (see NotConsecutive)

VOCAB = 96


def _config(attn: str = "sdpa"):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn,
    )


def _llama(attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(attn))


class CountingCheck:
    """transformers' packed-sequence check, counting its calls."""

    def __init__(self, check) -> None:
        self.check = check
        self.calls = 0

    def __call__(self, position_ids):
        self.calls += 1
        return self.check(position_ids)


@pytest.fixture
def adopted():
    model = _llama()
    report = torchgraft.adopt(model)
    yield model, report
    torchgraft.unadopt(model)
    torchgraft.disable()
    torch._dynamo.reset()


def _rows(report, kind: str):
    return [r for r in report.rows if r.kind == kind]


def _packed_positions() -> torch.Tensor:
    return torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7], list(range(12))])


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_check_and_the_base_model_are_adopted_for_sdpa_models_only(adopted):
    _, report = adopted
    rows = _rows(report, "default_positions")
    assert [(r.layer, r.status) for r in rows] == [
        ("find_packed_sequence_indices", "adopted"),
        ("LlamaModel", "adopted"),
    ]
    eager = _llama(attn="eager")
    try:
        assert _rows(torchgraft.adopt(eager), "default_positions") == []
    finally:
        torchgraft.unadopt(eager)


def test_compiled_without_cache_takes_is_causal_and_the_loss_and_gradients_are_stock(adopted):
    model, _ = adopted
    stock = _llama()
    ids = torch.randint(0, VOCAB, (2, 12))
    want = _loss_and_grads(stock, input_ids=ids, labels=ids, use_cache=False)
    backend = SdpaCalls()
    torchgraft.enable()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = _loss_and_grads(compiled, input_ids=ids, labels=ids, use_cache=False)
    assert backend.calls and all(call == (False, True) for call in backend.calls)
    _assert_same(got, want)


def test_packed_positions_keep_their_mask_compiled_and_eager(adopted):
    model, _ = adopted
    stock = _llama()
    ids = torch.randint(0, VOCAB, (2, 12))
    kwargs = {"input_ids": ids, "labels": ids, "position_ids": _packed_positions()}
    want = _loss_and_grads(stock, use_cache=False, **kwargs)
    unpacked = _loss_and_grads(stock, use_cache=False, input_ids=ids, labels=ids)
    assert not torch.allclose(want[0], unpacked[0])  # the packing changes the loss
    torchgraft.enable()
    _assert_same(_loss_and_grads(model, use_cache=False, **kwargs), want)
    backend = SdpaCalls()
    compiled = torch.compile(model, backend=backend)
    _assert_same(_loss_and_grads(compiled, use_cache=False, **kwargs), want)
    assert backend.calls and all(mask for mask, _ in backend.calls)


def test_eager_derived_positions_skip_the_check_and_passed_ones_run_it(monkeypatch):
    counting = CountingCheck(masking_utils.find_packed_sequence_indices)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    model = _llama()
    ids = torch.randint(0, VOCAB, (2, 12))
    try:
        torchgraft.adopt(model)
        torchgraft.enable()
        counting.calls = 0
        model(input_ids=ids, use_cache=False)
        assert counting.calls == 0
        model(input_ids=ids, use_cache=False, position_ids=_packed_positions())
        assert counting.calls == 1
        with torchgraft.disabled():
            model(input_ids=ids, use_cache=False)
        assert counting.calls == 2
        assert default_positions._POSITIONS.derived is False  # restored after each call
    finally:
        torchgraft.unadopt(model)
        torchgraft.disable()
    assert masking_utils.find_packed_sequence_indices is counting


def test_while_torchgraft_is_off_the_compiled_model_builds_the_mask(adopted):
    model, _ = adopted
    ids = torch.randint(0, VOCAB, (2, 12))
    backend = SdpaCalls()
    with torchgraft.disabled():
        torch.compile(model, backend=backend)(input_ids=ids, use_cache=False)
    assert backend.calls and all(mask for mask, _ in backend.calls)


class NotConsecutive(transformers.LlamaModel):
    """A base model whose derived positions are not 0..L-1: the claim does not hold for it."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None:
            position_ids = 2 * torch.arange(input_ids.shape[1]).unsqueeze(0)
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )


def test_a_base_model_whose_derived_positions_are_not_consecutive_is_not_adopted():
    torch.manual_seed(0)
    model = NotConsecutive(_config())
    try:
        rows = _rows(torchgraft.adopt(model), "default_positions")
        base = next(r for r in rows if r.layer == "NotConsecutive")
        assert base.status == "skipped"
        assert "not consecutive" in base.reason
    finally:
        torchgraft.unadopt(model)
