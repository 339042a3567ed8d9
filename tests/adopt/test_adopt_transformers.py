"""torchgraft.adopt on tiny transformers models (random weights, from configs): for each family,
the adopted model's logits, loss and gradients match the unadopted model's, the grafts ran, and
unadopt restores every forward. Then what a training setup needs: save/load, gradient
checkpointing, torch.compile, the kernels package, and the fused-op adopters (MLP, RoPE, loss)
against the functional contract."""

from __future__ import annotations

import gc
import sys
import warnings

import pytest
import torch

import torchgraft
from adopt_helpers import (
    FAMILIES,
    RMS_NORM_VARIANT,
    assert_steps_close,
    batch,
    contract_module,
    enabled_throughout,
    instance_forwards,
    rel_err,
    tiny_model,
    train_step,
    use_functional,
)
from torchgraft.adopt.probe import TOLERANCE
from torchgraft.adopt.report import ADOPTED, SKIPPED

pytestmark = pytest.mark.default_torch

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _collect_dropped_models():
    # A model adopted and dropped without unadopt releases its hold on a module-global function
    # (RoPE) when it is collected; an adopted model refers to itself (its instance forwards),
    # so that waits for the cyclic collector: run it, so no test starts with another's hold.
    # Adopted layers run torchgraft's operators only while it is enabled.
    with enabled_throughout():
        yield
    gc.collect()


FUSED_KINDS = ("gated_mlp", "rope", "causal_lm_loss")


def _norms(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_adopts_rms_norm_matches_and_unadopt_restores(family):
    model = tiny_model(family)
    ids, labels = batch()
    ref = train_step(model, ids, labels)

    report = torchgraft.adopt(model)
    rows = [r for r in report.rows if r.kind == "rms_norm"]
    assert sorted(r.path for r in rows) == sorted(_norms(model))
    route = f"{RMS_NORM_VARIANT[family]} -> torchgraft::rms_norm"
    assert all((r.status, r.route) == (ADOPTED, route) for r in rows), report.table(False)
    # The fused-op adopters either adopt (the op exists in torchgraft.functional and the probe
    # agreed) or say why not.
    for r in report.rows:
        if r.kind in FUSED_KINDS:
            assert r.status == ADOPTED or (r.status == SKIPPED and r.reason), r
    adopted = [r for r in report.rows if r.status == ADOPTED]
    mlps = [r for r in adopted if r.kind == "gated_mlp"]

    with torchgraft.enabled():
        torchgraft.reset_stats()
        step = train_step(model, ids, labels)
        stats = torchgraft.stats()
    # One kernel each way per norm.
    assert stats["native/torchgraft::rms_norm/CPU"]["calls"] == len(rows)
    assert stats["native/torchgraft::rms_norm_backward/CPU"]["calls"] == len(rows)
    assert stats["native/aten::_fused_rms_norm/CPU"]["calls"] == 0
    if mlps:
        fused = sum(v["calls"] for k, v in stats.items() if "glu/CPU" in k and "backward" not in k)
        assert fused == len(mlps), stats
    assert_steps_close(step, ref, TOLERANCE[torch.float32])

    assert torchgraft.unadopt(model) == len(adopted)
    assert instance_forwards(model) == {}
    again = train_step(model, ids, labels)
    assert torch.equal(again.logits, ref.logits) and torch.equal(again.loss, ref.loss)


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
def test_bfloat16_models_follow_the_model_numerics(family):
    # One family per variant: llama-style, gemma-style (1 + weight), fp32-weight.
    model = tiny_model(family).to(torch.bfloat16)
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    torchgraft.adopt(model)
    with torchgraft.enabled():
        step = train_step(model, ids, labels)
    assert_steps_close(step, ref, TOLERANCE[torch.bfloat16])
    torchgraft.unadopt(model)


def test_save_pretrained_and_from_pretrained(tmp_path):
    import transformers

    model = tiny_model("llama")
    keys = list(model.state_dict())
    torchgraft.adopt(model)
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert list(loaded.state_dict()) == keys
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids, labels = batch()
    plain = train_step(loaded, ids, labels)  # a fresh model: nothing adopted
    assert instance_forwards(loaded) == {}
    assert_steps_close(train_step(model, ids, labels), plain, TOLERANCE[torch.float32])
    assert torchgraft.adopt(loaded).count("rms_norm") == 5
    assert_steps_close(train_step(loaded, ids, labels), plain, TOLERANCE[torch.float32])


@pytest.mark.compat
def test_gradient_checkpointing():
    model = tiny_model("qwen3")
    model.train()
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    model.gradient_checkpointing_enable()
    torchgraft.adopt(model)
    with torchgraft.enabled():
        torchgraft.reset_stats()
        step = train_step(model, ids, labels)
        calls = torchgraft.stats()["native/torchgraft::rms_norm/CPU"]["calls"]
    # The checkpointed layers' norms run again in the backward.
    assert calls > len(_norms(model))
    assert_steps_close(step, ref, TOLERANCE[torch.float32])


@pytest.mark.compat
def test_torch_compile_of_the_adopted_model():
    model = tiny_model("llama")
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    torchgraft.adopt(model)
    compiled = torch.compile(model, backend="eager")  # aot_eager: tests/adopt/test_adopt.py
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = train_step(compiled, ids, labels)
    assert_steps_close(step, ref, TOLERANCE[torch.float32])
    torch._dynamo.reset()


def test_the_kernels_package_serves_tagged_layers_offline():
    pytest.importorskip("kernels")
    model = tiny_model("llama")
    gemma = tiny_model("gemma")  # GemmaRMSNorm has no hub tag: set on forward
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    adopted = {}
    for m, via in ((model, "kernels"), (gemma, "forward")):
        report = torchgraft.adopt(m, via="kernels")
        rows = [r for r in report.rows if r.kind == "rms_norm"]
        assert rows and all((r.status, r.via) == (ADOPTED, via) for r in rows)
        adopted[id(m)] = sum(r.status == ADOPTED for r in report.rows)
    from torchgraft.adopt import hub

    layer = type(vars(model.model.norm)["forward"].__func__)
    assert layer is not None
    assert any(
        cls.forward is vars(model.model.norm)["forward"].__func__ for cls in hub._layers.values()
    )
    assert_steps_close(train_step(model, ids, labels), ref, TOLERANCE[torch.float32])
    assert torchgraft.unadopt(model) == adopted[id(model)] and instance_forwards(model) == {}
    torchgraft.unadopt(gemma)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_fused_op_adopters_against_the_functional_contract(monkeypatch, family):
    # The MLP, RoPE and loss adopters, driven by a stand-in torchgraft.functional computing the
    # contract's eager expressions (the real ops land separately).
    use_functional(monkeypatch, contract_module())
    model = tiny_model(family)
    pymod = sys.modules[type(model).__module__]
    own_rope = pymod.apply_rotary_pos_emb
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    report = torchgraft.adopt(model)
    expect = {
        "llama": "swiglu -> torchgraft::swiglu",
        "gemma2": "geglu(approximate='tanh') -> torchgraft::geglu",
        "phi3": "swiglu -> torchgraft::swiglu",
    }[family]
    for kind, n, route in (
        ("gated_mlp", 2, expect),
        ("rope", 1, "rotate_half -> torchgraft::rope"),
        ("causal_lm_loss", 1, "ForCausalLMLoss -> torchgraft::cross_entropy"),
    ):
        rows = [r for r in report.rows if r.kind == kind]
        assert len(rows) == n and all((r.status, r.route) == (ADOPTED, route) for r in rows), (
            report.table(False)
        )
    # The fused head + loss, except where the model soft-caps its logits after the head.
    (head,) = [r for r in report.rows if r.kind == "causal_lm_head"]
    if family == "gemma2":
        assert head.status == SKIPPED and "final_logit_softcapping" in head.reason
    else:
        assert head.route == "fused head + loss -> torchgraft::linear_cross_entropy"
        assert head.status == ADOPTED and "forward" in vars(model)
    assert pymod.apply_rotary_pos_emb is not own_rope
    assert "_loss_function" in vars(model)
    again = torchgraft.adopt(model)
    assert {r.status for r in again.rows if r.kind not in ("hub_layer", "causal_lm_head")} == {
        "already adopted"
    }
    with torchgraft.enabled():
        step = train_step(model, ids, labels)
    assert_steps_close(step, ref, TOLERANCE[torch.float32])

    # A second model of the family shares the process-wide RoPE until both let go.
    other = tiny_model(family, seed=3)
    assert [r.status for r in torchgraft.adopt(other).rows if r.kind == "rope"] == [ADOPTED]
    torchgraft.unadopt(model)
    assert pymod.apply_rotary_pos_emb is not own_rope
    torchgraft.unadopt(other)
    assert pymod.apply_rotary_pos_emb is own_rope
    assert "_loss_function" not in vars(model) and instance_forwards(model) == {}
    again = train_step(model, ids, labels)
    assert torch.equal(again.logits, ref.logits) and torch.equal(again.loss, ref.loss)


def test_a_collected_model_lets_go_of_the_global_rope(monkeypatch):
    use_functional(monkeypatch, contract_module())
    model = tiny_model("qwen2")
    pymod = sys.modules[type(model).__module__]
    own_rope = pymod.apply_rotary_pos_emb
    torchgraft.adopt(model)
    assert pymod.apply_rotary_pos_emb is not own_rope
    del model
    gc.collect()
    assert pymod.apply_rotary_pos_emb is own_rope


def test_the_loss_adopter_keeps_gradient_accumulation_semantics(monkeypatch):
    use_functional(monkeypatch, contract_module())
    model = tiny_model("mistral")
    _, labels = batch()
    own = model.loss_function
    torchgraft.adopt(model)
    logits = torch.randn(2, 10, model.config.vocab_size, requires_grad=True)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(11)}, {"num_items_in_batch": 5}):
        out = model.loss_function(logits=logits, labels=labels, vocab_size=96, **kwargs)
        ref = own(logits=logits, labels=labels, vocab_size=96, **kwargs)
        assert rel_err(out, ref) <= 1e-6
    torchgraft.unadopt(model)


@pytest.mark.compat
def test_the_real_functional_ops_are_used_when_this_build_has_them():
    try:
        import torchgraft.functional as functional
    except ImportError:
        functional = None
    model = tiny_model("llama")
    report = torchgraft.adopt(model)
    for kind, op in (
        ("gated_mlp", "swiglu"),
        ("rope", "rope"),
        ("causal_lm_loss", "cross_entropy"),
    ):
        rows = [r for r in report.rows if r.kind == kind]
        assert rows
        if callable(getattr(functional, op, None)):
            assert all(r.status == ADOPTED for r in rows), report.table(False)
        else:
            assert all(
                r.status == SKIPPED
                and r.reason.startswith(
                    f"op not available in this build: torchgraft.functional.{op}"
                )
                for r in rows
            )
    torchgraft.unadopt(model)


def test_mlps_are_recognized_without_the_kernels_package(monkeypatch):
    # Without `kernels` installed (the GPU machines), transformers sets no hub tag on its
    # activation classes: SiLUActivation must still be recognized, by class.
    from transformers.activations import SiLUActivation

    monkeypatch.delattr(SiLUActivation, "kernel_layer_name", raising=False)
    model = tiny_model("llama")
    ids, labels = batch()
    ref = train_step(model, ids, labels)
    report = torchgraft.adopt(model, via="forward")
    mlps = [r for r in report.rows if r.kind == "gated_mlp"]
    assert mlps and all(r.status == ADOPTED for r in mlps), report.table(False)
    with torchgraft.enabled():
        assert_steps_close(train_step(model, ids, labels), ref, TOLERANCE[torch.float32])
    torchgraft.unadopt(model)
