"""torchgraft.adopt on hand-written layers (no transformers): which layers are found, which
variant each takes, verification refusing what does not match, and everything adoption must keep
(parameters, state_dict, hooks, .to(), copies, the random state) and unadopt must restore."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgraft
from adopt_helpers import (
    contract_module,
    enabled_throughout,
    instance_forwards,
    rel_err,
    switched,
    use_functional,
)
from torchgraft.adopt.probe import TOLERANCE
from torchgraft.adopt.report import ADOPTED, ALREADY, NATIVE, SKIPPED

pytestmark = pytest.mark.default_torch


@pytest.fixture(autouse=True)
def _enabled():
    # Adopted layers run torchgraft's operators only while it is enabled.
    with enabled_throughout():
        yield


def _n(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.weight * _n(hidden_states, self.variance_epsilon).to(hidden_states.dtype)


class Fp32WeightRMSNorm(LlamaStyleRMSNorm):  # OLMo2
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        n = _n(hidden_states, self.variance_epsilon)
        return (self.weight * n).to(hidden_states.dtype)


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_n(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class UnweightedRMSNorm(nn.Module):  # NanoChat
    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _n(x, self.eps).type_as(x)


class CenteredRMSNorm(LlamaStyleRMSNorm):
    """Named like an RMSNorm, computes a LayerNorm: verification must refuse it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x - x.mean(-1, keepdim=True)
        return self.weight * _n(x, self.variance_epsilon).to(hidden_states.dtype)


class NoisyRMSNorm(LlamaStyleRMSNorm):
    """Dropout in training mode: no replacement can match it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        return F.dropout(out, 0.5, self.training)


class GatedRMSNorm(LlamaStyleRMSNorm):
    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) * F.silu(gate)


class ResidualRMSNorm(LlamaStyleRMSNorm):
    """An optional second input: a one-input replacement could meet a call passing it."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        out = super().forward(hidden_states)
        return out if residual is None else out + residual


class Block(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + 0.8)
    return model


def _x(dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 5, 16, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize(
    ("norm", "variant"),
    [
        (LlamaStyleRMSNorm(16), "llama-style"),
        (Fp32WeightRMSNorm(16), "fp32-weight"),
        (GemmaStyleRMSNorm(16), "gemma-style (1 + weight)"),
        (UnweightedRMSNorm(), "unweighted"),
    ],
    ids=["llama", "fp32-weight", "gemma", "unweighted"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rms_norm_takes_its_own_variant_and_computes_what_the_model_does(norm, variant, dtype):
    model = _randomize(Block(norm)).to(dtype)
    x = _x(dtype).requires_grad_(True)
    ref = model(x)
    (ref_dx,) = torch.autograd.grad(ref.sum(), x)
    report = torchgraft.adopt(model)
    (row,) = [r for r in report.rows if r.kind == "rms_norm"]
    assert (row.status, row.route) == (ADOPTED, f"{variant} -> torchgraft::rms_norm")
    for graft in (False, True):
        with switched(graft):
            torchgraft.reset_stats()
            out = model(x)
            (dx,) = torch.autograd.grad(out.sum(), x)
            # torchgraft's own op, one kernel each way, while enabled; the model's own code
            # (no torchgraft kernel) while disabled.
            got = torchgraft.stats()
            assert got["native/torchgraft::rms_norm/CPU"]["calls"] == int(graft)
            assert got["native/torchgraft::rms_norm_backward/CPU"]["calls"] == int(graft)
        assert out.dtype == ref.dtype
        assert rel_err(out, ref) <= TOLERANCE[dtype]
        assert rel_err(dx, ref_dx) <= TOLERANCE[dtype]
        if not graft:
            assert torch.equal(out, ref)
    assert torchgraft.unadopt(model) == 1
    assert instance_forwards(model) == {}
    assert torch.equal(model(x), ref)


@pytest.mark.parametrize(
    ("norm", "variant"),
    [
        (LlamaStyleRMSNorm(1000), "llama-style"),
        (Fp32WeightRMSNorm(1000), "fp32-weight"),
        (GemmaStyleRMSNorm(1000), "gemma-style (1 + weight)"),
        (UnweightedRMSNorm(), "unweighted"),
    ],
    ids=["llama", "fp32-weight", "gemma", "unweighted"],
)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_adopted_norms_are_the_model_to_the_last_bit_but_for_rare_ties(norm, variant, weight_dtype):
    # The op rounds where the model rounds; only its float32 sum of squares is in another order
    # than torch's mean, which flips a last bit of rstd now and then (and so, rarely, one unit in
    # the last place of a bfloat16 output).
    norm = _randomize(norm).to(weight_dtype)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 1000, generator=gen) * 2 + 0.3).to(torch.bfloat16).requires_grad_(True)
    ref = norm(x)
    (ref_dx,) = torch.autograd.grad(ref.float().sum(), x)
    (row,) = torchgraft.adopt(norm).rows
    assert (row.status, row.route) == (ADOPTED, f"{variant} -> torchgraft::rms_norm")
    out = norm(x)
    (dx,) = torch.autograd.grad(out.float().sum(), x)
    assert out.dtype == ref.dtype
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp_min(1e-30)
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    assert (out == ref).float().mean() > 0.995
    assert rel_err(dx, ref_dx) <= TOLERANCE[torch.bfloat16]
    torchgraft.unadopt(norm)


@pytest.mark.parametrize(
    ("norm", "variant"),
    [
        (LlamaStyleRMSNorm(16), "llama-style"),
        (Fp32WeightRMSNorm(16), "fp32-weight"),
        (GemmaStyleRMSNorm(16), "gemma-style (1 + weight)"),
        (UnweightedRMSNorm(), "unweighted"),
    ],
    ids=["llama", "fp32-weight", "gemma", "unweighted"],
)
def test_without_the_op_the_f_rms_norm_routes_serve(monkeypatch, norm, variant):
    use_functional(monkeypatch, contract_module())  # a build without functional.rms_norm
    model = _randomize(Block(norm)).to(torch.bfloat16)
    x = _x(torch.bfloat16).requires_grad_(True)
    ref = model(x)
    (ref_dx,) = torch.autograd.grad(ref.sum(), x)
    (row,) = torchgraft.adopt(model).rows
    assert (row.status, row.route) == (ADOPTED, f"{variant} -> aten::_fused_rms_norm")
    with torchgraft.enabled():
        torchgraft.reset_stats()
        out = model(x)
        (dx,) = torch.autograd.grad(out.sum(), x)
        assert torchgraft.stats()["native/aten::_fused_rms_norm/CPU"]["calls"] == 1
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    assert rel_err(dx, ref_dx) <= TOLERANCE[torch.bfloat16]
    torchgraft.unadopt(model)


def test_a_float64_gemma_norm_falls_back_to_the_f_rms_norm_route():
    # Gemma computes in float32 even for float64 inputs (x.float()); the op would compute in
    # float64 and the probe refuses it: the F.rms_norm route, which casts as the model does, serves.
    # Probed with torchgraft disabled: stock F.rms_norm agrees with the model's float32
    # arithmetic to the float64 tolerance; the grafted float32 kernel rounds in another order
    # (6e-8, a float32 tolerance), which a float64 probe would refuse.
    model = _randomize(Block(GemmaStyleRMSNorm(16))).double()
    x = _x(torch.float64)
    with switched(False):
        ref = model(x)
        (row,) = torchgraft.adopt(model).rows
    assert (row.status, row.route) == (ADOPTED, "gemma-style (1 + weight) -> aten::_fused_rms_norm")
    torchgraft.reset_stats()
    assert rel_err(model(x), ref) <= TOLERANCE[torch.float32]
    assert torchgraft.stats()["native/aten::_fused_rms_norm/CPU"]["calls"] == 1
    torchgraft.unadopt(model)


@pytest.mark.parametrize(
    ("norm", "variant"),
    [
        (LlamaStyleRMSNorm(16), "llama-style, weight fused"),
        (Fp32WeightRMSNorm(16), "fp32-weight"),
        (GemmaStyleRMSNorm(16), "gemma-style (1 + weight), weight fused"),
    ],
    ids=["llama", "fp32-weight", "gemma"],
)
def test_fuse_weight_puts_the_weight_in_the_kernel_within_tolerance(monkeypatch, norm, variant):
    # fuse_weight shapes the F.rms_norm routes, those of a build without functional.rms_norm
    # (whose variants are one kernel each way already, with the model's rounding).
    use_functional(monkeypatch, contract_module())
    model = _randomize(Block(norm)).to(torch.bfloat16)
    x = _x(torch.bfloat16).requires_grad_(True)
    ref = model(x)
    (ref_dx,) = torch.autograd.grad(ref.sum(), x)
    (row,) = torchgraft.adopt(model, fuse_weight=True).rows
    assert (row.status, row.route) == (ADOPTED, f"{variant} -> aten::_fused_rms_norm")
    with torchgraft.enabled():
        out = model(x)
        (dx,) = torch.autograd.grad(out.sum(), x)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    assert rel_err(dx, ref_dx) <= TOLERANCE[torch.bfloat16]
    torchgraft.unadopt(model)


def test_fuse_weight_changes_nothing_where_the_op_exists():
    model = _randomize(Block(LlamaStyleRMSNorm(16))).to(torch.bfloat16)
    (row,) = torchgraft.adopt(model, fuse_weight=True).rows
    assert (row.status, row.route) == (ADOPTED, "llama-style -> torchgraft::rms_norm")
    torchgraft.unadopt(model)


@pytest.mark.parametrize(
    ("norm", "why"),
    [
        (CenteredRMSNorm(16), "no variant matches"),
        (NoisyRMSNorm(16), "no variant matches"),
        (GatedRMSNorm(16), "other arguments than one input"),
        (ResidualRMSNorm(16), "other arguments than one input"),
    ],
    ids=["centered", "dropout", "gated", "optional-residual"],
)
def test_layers_no_variant_matches_are_left_exactly_as_they_were(norm, why):
    model = _randomize(Block(norm))
    before = instance_forwards(model)
    report = torchgraft.adopt(model)
    (row,) = report.rows
    assert row.status == SKIPPED and why in row.reason
    assert instance_forwards(model) == before
    assert torchgraft.unadopt(model) == 0


def test_nn_rms_norm_is_native_and_left_alone():
    model = Block(nn.RMSNorm(16, eps=1e-5))
    report = torchgraft.adopt(model)
    (row,) = report.rows
    assert (row.status, row.layer) == (NATIVE, "RMSNorm")
    assert instance_forwards(model) == {}


def test_the_llama_claim_f_rms_norm_without_weight_is_the_float32_expression_rounded_once():
    # F.rms_norm(x, [H], None, eps) == (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype):
    # in half precision to the last bit but for the rare tie the float32 sum order flips (one
    # unit in the last place), stock and grafted; in float32 the sum order and rsqrt show in the
    # last bits (a few units).
    gen = torch.Generator().manual_seed(0)
    for dtype, ulps in ((torch.bfloat16, 1), (torch.float16, 1), (torch.float32, 4)):
        x = (torch.randn(64, 1000, generator=gen) * 3 + 0.5).to(dtype)
        expr = _n(x, 1e-6).to(dtype)
        exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            dtype
        )
        for graft in (False, True):
            with switched(graft):
                torchgraft.reset_stats()
                out = F.rms_norm(x, [1000], None, 1e-6)
                ran = torchgraft.stats()["native/aten::_fused_rms_norm/CPU"]["calls"]
            assert ran == int(graft)
            assert out.dtype == dtype
            tiny = torch.finfo(dtype).tiny
            ulp = torch.finfo(dtype).eps * expr.float().abs().clamp_min(tiny)
            assert ((out.float() - expr.float()).abs() <= ulps * ulp).all()
            if dtype != torch.float32:  # one rounding to half precision dominates
                assert ((out.float() - exact.float()).abs() <= ulp).all()


def test_adoption_keeps_parameters_state_dict_hooks_and_to():
    model = _randomize(nn.Sequential(Block(LlamaStyleRMSNorm(16)), Block(GemmaStyleRMSNorm(16))))
    model[0].norm.register_buffer("seen", torch.zeros(2))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list[str] = []
    norm = model[0].norm
    norm.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    norm.register_forward_hook(lambda m, args, out: calls.append("post"))
    norm.register_full_backward_hook(lambda m, gin, gout: calls.append("backward"))
    x = _x().requires_grad_(True)
    ref = model(x)
    ref.sum().backward()
    assert calls == ["pre", "post", "backward"]
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    report = torchgraft.adopt(model)
    assert report.count("rms_norm") == 2
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert dict(model.named_buffers()) == buffers
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    calls.clear()
    model.zero_grad()
    out = model(x)
    out.sum().backward()
    assert calls == ["pre", "post", "backward"]
    assert rel_err(out, ref) <= 1e-6
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-5, n

    # A state dict loaded after adoption is what the adopted layers use.
    reloaded = {k: v * 1.5 for k, v in state.items()}
    model.load_state_dict(reloaded)
    plain = copy.deepcopy(model)
    torchgraft.unadopt(plain)
    assert rel_err(model(x), plain(x)) <= 1e-6

    # .to() after adoption: the adopted layers follow the parameters' dtype.
    model.to(torch.bfloat16)
    plain.to(torch.bfloat16)
    xb = x.detach().to(torch.bfloat16)
    assert model(xb).dtype == torch.bfloat16
    assert rel_err(model(xb), plain(xb)) <= TOLERANCE[torch.bfloat16]


def test_adopt_twice_reports_already_adopted_and_unadopt_restores_once():
    model = Block(LlamaStyleRMSNorm(16))
    assert torchgraft.adopt(model).count() == 1
    again = torchgraft.adopt(model)
    assert [r.status for r in again.rows] == [ALREADY]
    assert torchgraft.unadopt(model) == 1
    assert torchgraft.unadopt(model) == 0
    assert instance_forwards(model) == {}


def test_unadopt_restores_a_forward_someone_had_patched_before():
    model = Block(LlamaStyleRMSNorm(16))
    norm = model.norm

    def patched(x: torch.Tensor) -> torch.Tensor:
        return LlamaStyleRMSNorm.forward(norm, x)

    norm.forward = patched
    assert torchgraft.adopt(model).count() == 1
    assert vars(norm)["forward"] is not patched
    torchgraft.unadopt(model)
    assert vars(norm)["forward"] is patched


def test_unadopt_leaves_a_forward_replaced_after_adoption_and_warns():
    model = Block(LlamaStyleRMSNorm(16))
    torchgraft.adopt(model)

    def later(x: torch.Tensor) -> torch.Tensor:
        return x

    model.norm.forward = later
    with pytest.warns(UserWarning, match=r"norm\.forward was replaced after adoption"):
        assert torchgraft.unadopt(model) == 0
    assert vars(model.norm)["forward"] is later


def test_copies_of_an_adopted_model_are_adopted_and_unadopt_on_their_own():
    model = _randomize(Block(LlamaStyleRMSNorm(16)))
    torchgraft.adopt(model)
    clone = copy.deepcopy(model)
    assert vars(clone.norm)["forward"].__self__ is clone.norm
    x = _x()
    assert torch.equal(clone(x), model(x))
    assert torchgraft.unadopt(clone) == 1
    assert instance_forwards(clone) == {}
    assert "forward" in vars(model.norm)


def test_whole_model_pickling_round_trips(tmp_path):
    model = _randomize(Block(GemmaStyleRMSNorm(16)))
    torchgraft.adopt(model)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    x = _x()
    assert rel_err(loaded(x), model(x)) <= 1e-6


def test_adopt_leaves_the_random_state_and_grad_mode_alone():
    model = _randomize(Block(NoisyRMSNorm(16)))
    state = torch.random.get_rng_state()
    with torch.no_grad():
        report = torchgraft.adopt(model)
        assert not torch.is_grad_enabled()
    assert report.rows[0].status == SKIPPED
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.inference_mode():
        assert torchgraft.adopt(Block(LlamaStyleRMSNorm(16))).count() == 1


def test_training_mode_is_restored_after_probing():
    model = Block(LlamaStyleRMSNorm(16)).eval()
    torchgraft.adopt(model)
    assert not any(m.training for m in model.modules())


def test_via_forward_kernels_and_no_kernels(monkeypatch):
    pytest.importorskip("kernels")

    class TaggedRMSNorm(LlamaStyleRMSNorm):
        kernel_layer_name = "RMSNorm"  # what kernels' use_kernel_forward_from_hub sets

    for via, expect in (("forward", "forward"), ("kernels", "kernels"), ("auto", "kernels")):
        model = _randomize(Block(TaggedRMSNorm(16)))
        x = _x()
        ref = model(x)
        (row,) = torchgraft.adopt(model, via=via).rows
        assert (row.status, row.via) == (ADOPTED, expect)
        assert rel_err(model(x), ref) <= 1e-6
        assert torchgraft.unadopt(model) == 1
        assert instance_forwards(model) == {}

    # Without the kernels package adopt() needs nothing beyond torch.
    monkeypatch.setitem(sys.modules, "kernels", None)
    model = Block(TaggedRMSNorm(16))
    (row,) = torchgraft.adopt(model).rows
    assert (row.status, row.via) == (ADOPTED, "forward")
    with pytest.raises(ImportError, match="kernels"):
        torchgraft.adopt(Block(TaggedRMSNorm(16)), via="kernels")
    with pytest.raises(ValueError, match="via must be one of"):
        torchgraft.adopt(model, via="hub")


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"adopt\(\) expects a torch.nn.Module, got function"):
        torchgraft.adopt(lambda x: x)
    with pytest.raises(TypeError, match=r"unadopt\(\) expects a torch.nn.Module, got int"):
        torchgraft.unadopt(3)


def test_the_hub_tag_does_not_decide_the_variant():
    # Qwen3.5's RMSNorm carries the tag "RMSNorm" and computes the gemma-style formula.
    class TaggedGemmaStyle(GemmaStyleRMSNorm):
        kernel_layer_name = "RMSNorm"

    model = _randomize(Block(TaggedGemmaStyle(16)))
    x = _x()
    ref = model(x)
    (row,) = torchgraft.adopt(model).rows
    assert (row.status, row.route) == (ADOPTED, "gemma-style (1 + weight) -> torchgraft::rms_norm")
    assert rel_err(model(x), ref) <= 1e-6
    torchgraft.unadopt(model)


def test_when_kernels_declines(monkeypatch):
    pytest.importorskip("kernels")
    from torchgraft.adopt import hub

    class TaggedRMSNorm(LlamaStyleRMSNorm):
        kernel_layer_name = "RMSNorm"

    def refuse(*args: object) -> None:
        raise RuntimeError("no layer for you")

    monkeypatch.setattr(hub, "kernelize", refuse)
    model = Block(TaggedRMSNorm(16))
    (row,) = torchgraft.adopt(model).rows  # auto: falls back to setting forward
    assert (row.status, row.via) == (ADOPTED, "forward")
    assert "kernels declined (RuntimeError: no layer for you)" in row.reason
    assert torchgraft.unadopt(model) == 1 and instance_forwards(model) == {}
    (row,) = torchgraft.adopt(model, via="kernels").rows  # insisting: left alone
    assert (row.status, row.reason) == (SKIPPED, "kernels declined: RuntimeError: no layer for you")
    assert instance_forwards(model) == {} and torchgraft.unadopt(model) == 0

    # kernels' own switch (DISABLE_KERNEL_MAPPING) makes it put the class's forward instead.
    monkeypatch.undo()
    monkeypatch.setattr("kernels.layer.layer._DISABLE_KERNEL_MAPPING", True)
    (row,) = torchgraft.adopt(model, via="kernels").rows
    assert row.status == SKIPPED and "kept the layer's own forward" in row.reason
    assert instance_forwards(model) == {}


def test_hub_tagged_layers_without_an_adopter_are_reported():
    class Gelu(nn.Module):
        kernel_layer_name = "FastGELU"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x)

    report = torchgraft.adopt(nn.Sequential(nn.Linear(4, 4), Gelu()))
    (row,) = report.rows
    assert (row.kind, row.status) == ("hub_layer", SKIPPED)
    assert "'FastGELU'" in row.reason


class TorchtitanFeedForward(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TorchtitanRMSNorm(nn.Module):
    """torchtitan's own RMSNorm class before it moved to nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _n(x, self.eps).type_as(x) * self.weight


class TorchtitanBlock(nn.Module):
    def __init__(self, old_norm: bool) -> None:
        super().__init__()
        norm = TorchtitanRMSNorm if old_norm else nn.RMSNorm
        self.attention_norm, self.ffn_norm = norm(16), norm(16)
        self.wqkv = nn.Linear(16, 48, bias=False)
        self.wo = nn.Linear(16, 16, bias=False)
        self.feed_forward = TorchtitanFeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, 2, 8).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, 16))
        return x + self.feed_forward(self.ffn_norm(x))


@pytest.mark.parametrize("old_norm", [False, True], ids=["nn.RMSNorm", "own RMSNorm"])
@pytest.mark.parametrize("with_swiglu", [False, True], ids=["no-swiglu", "swiglu"])
def test_torchtitan_style_model(monkeypatch, old_norm, with_swiglu):
    use_functional(monkeypatch, contract_module(**({} if with_swiglu else {"swiglu": None})))
    model = _randomize(nn.Sequential(TorchtitanBlock(old_norm), TorchtitanBlock(old_norm)))
    x = _x().requires_grad_(True)
    ref = model(x)
    (ref_dx,) = torch.autograd.grad(ref.sum(), x)
    report = torchgraft.adopt(model)
    norms = [r for r in report.rows if r.kind == "rms_norm"]
    assert len(norms) == 4
    expect = (ADOPTED, "llama-style -> aten::_fused_rms_norm") if old_norm else (NATIVE, None)
    assert all((r.status, r.route if old_norm else None) == expect for r in norms)
    mlps = [r for r in report.rows if r.kind == "gated_mlp"]
    assert len(mlps) == 2
    if with_swiglu:
        assert all(r.status == ADOPTED and r.route == "swiglu -> torchgraft::swiglu" for r in mlps)
    else:
        assert all(
            r.status == SKIPPED and "op not available in this build" in r.reason for r in mlps
        )
    with torchgraft.enabled():
        torchgraft.reset_stats()
        out = model(x)
        (dx,) = torch.autograd.grad(out.sum(), x)
        assert torchgraft.stats()["native/aten::_fused_rms_norm/CPU"]["calls"] == 4
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(dx, ref_dx) <= 1e-5
    torchgraft.unadopt(model)
    assert instance_forwards(model) == {}


def test_a_fused_op_that_disagrees_is_not_adopted(monkeypatch):
    # A "swiglu" that computes GELU gating: the probe must catch it.
    use_functional(monkeypatch, contract_module(swiglu=lambda g, u: F.gelu(g) * u))
    model = _randomize(TorchtitanFeedForward())
    (row,) = torchgraft.adopt(model).rows
    assert row.status == SKIPPED
    assert "does not match" in row.reason and "output 0 differs" in row.reason
    assert instance_forwards(model) == {}


def test_report_table():
    model = nn.Sequential(
        Block(LlamaStyleRMSNorm(16)), Block(LlamaStyleRMSNorm(16)), Block(CenteredRMSNorm(16))
    )
    report = torchgraft.adopt(model)
    text = str(report)
    assert text.splitlines()[0] == "torchgraft.adopt: 2 of 3 layers adopted"
    assert "LlamaStyleRMSNorm" in text and "CenteredRMSNorm" in text
    grouped = [line for line in text.splitlines() if "LlamaStyleRMSNorm" in line]
    assert len(grouped) == 1 and " 2 " in grouped[0]
    flat = report.table(grouped=False)
    assert "0.norm" in flat and "1.norm" in flat and "2.norm" in flat
    assert len(report.adopted) == 2 and len(report.skipped) == 1


def test_adopted_model_compiles():
    model = _randomize(nn.Sequential(Block(LlamaStyleRMSNorm(16)), Block(GemmaStyleRMSNorm(16))))
    x = _x().requires_grad_(True)
    ref = model(x)
    (ref_dx,) = torch.autograd.grad(ref.sum(), x)
    torchgraft.adopt(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(x)
    (dx,) = torch.autograd.grad(out.sum(), x)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(dx, ref_dx) <= 1e-5
    torch._dynamo.reset()
