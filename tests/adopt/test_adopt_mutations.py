"""What a user changes on a model after ``torchgraft.adopt`` is honoured (issue 30).

Each test builds two identical tiny causal LMs from a config (random weights), adopts one, applies
the same change to both (hooks on adopted layers and on the children their replacements bypass,
global module hooks, peft LoRA, a custom loss, parametrizations, dtypes, swapped modules,
copies, pickles, the switches) and compares a training step of the two: loss and every
parameter's gradient, on fresh random tokens. Where the change leaves the replacement valid, the
torchgraft kernel must have run; where it does not, the layer must have run the model's own
forward and said so, once, naming itself.

Families: Llama (llama-style RMSNorm, SwiGLU, RoPE, head, loss), Gemma (gemma-style RMSNorm,
GeGLU tanh), Phi3 (gate_up_proj, partial rotary), GPT-NeoX (partial rotary, head and loss only).
"""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import torchgraft
from adopt_helpers import VOCAB, enabled_throughout, rel_err, switched, tiny_model
from torchgraft import control
from torchgraft.adopt import slots
from torchgraft.adopt.guard import AdoptionFallbackWarning, GuardedFunction
from torchgraft.adopt.report import ADOPTED, KILLED, SKIPPED

pytestmark = pytest.mark.default_torch

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "gemma", "phi3", "gpt_neox")
CONFIG = {"phi3": {"partial_rotary_factor": 0.5}, "gpt_neox": {"rotary_pct": 0.25}}
ACTIVATION = {"llama": "act_fn", "gemma": "act_fn", "phi3": "activation_fn"}
GATING = {"llama": "swiglu", "gemma": "geglu", "phi3": "swiglu"}
"""The families with a gated MLP, its activation child and the fused op it routes to."""
TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core machine: threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _enabled() -> Iterator[None]:
    with enabled_throughout():
        yield


_ADOPTED: dict[str, tuple[nn.Module, nn.Module]] = {}
"""Per family, a stock model and an adopted twin, adopted once (tests take deep copies)."""


@pytest.fixture(autouse=True, scope="module")
def _release_adopted() -> Iterator[None]:
    yield
    for family in list(_ADOPTED):
        _release(family)


def _release(family: str) -> None:
    """Unadopt the family's cached model; collect dropped copies: no model of the family holds
    the process-wide RoPE afterwards."""
    if family in _ADOPTED:
        torchgraft.unadopt(_ADOPTED.pop(family)[1])
    gc.collect()


@dataclass
class Pair:
    """Two identical models; ``adopted`` went through ``torchgraft.adopt``."""

    family: str
    stock: nn.Module
    adopted: nn.Module

    def apply(self, change: Callable[[nn.Module], nn.Module | None]) -> None:
        """The same change to both (with the same random state: LoRA's initial weights); a
        module ``change`` returns takes the model's place (peft's wrapper)."""
        for name in ("stock", "adopted"):
            torch.manual_seed(7)
            model = getattr(self, name)
            setattr(self, name, change(model) or model)


def pair(family: str, fresh: bool = False) -> Pair:
    """A stock model and its adopted twin: deep copies of ones adopted once per family (a copy
    of an adopted model is adopted: ``test_deepcopy_is_adopted_and_outlives_the_original``), or
    ``fresh`` ones (for tests of what the process-wide RoPE does when models let go of it)."""
    if fresh:
        _release(family)
    if fresh or family not in _ADOPTED:
        stock, adopted = (tiny_model(family, **CONFIG.get(family, {})) for _ in range(2))
        report = torchgraft.adopt(adopted)
        assert report.count("causal_lm_head") == 1, report.table(False)
        if fresh:
            return Pair(family, stock, adopted)
        _ADOPTED[family] = (stock, adopted)
    stock, adopted = _ADOPTED[family]
    return Pair(family, copy.deepcopy(stock), copy.deepcopy(adopted))


def step(model: nn.Module, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training step on random tokens: the loss and every parameter's gradient."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@dataclass
class Outcome:
    """The adopted model's step against the stock one's."""

    calls: dict[str, int]
    """torchgraft kernel calls (``"rms_norm"``, ``"swiglu"``...) in the adopted model's step."""
    fallbacks: list[str]
    """The fallback warnings it gave."""


def compare(p: Pair, seed: int = 11, tol: float = TOL) -> Outcome:
    """Loss and every gradient of the adopted model equal the stock model's within ``tol``."""
    ref_loss, ref_grads = step(p.stock, seed)
    torchgraft.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = step(p.adopted, seed)
    calls = {
        key.split("::")[1].removesuffix("/CPU"): v["calls"]
        for key, v in torchgraft.stats().items()
        if key.startswith("native/torchgraft::") and key.endswith("/CPU")
    }
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss)), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= tol, name
    warned = [str(w.message) for w in caught if issubclass(w.category, AdoptionFallbackWarning)]
    return Outcome(calls, warned)


def module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


# ---- hooks on the adopted layers themselves: they run, and the replacement still serves -------


def _scaled(out: object, by: float) -> object:
    if isinstance(out, torch.Tensor):
        return out * by
    out["loss"] = out["loss"] * by  # a ModelOutput
    return out


def _first_scaled(args: tuple[object, ...], by: float) -> tuple[object, ...]:
    return (args[0] * by, *args[1:])  # type: ignore[operator]


HOOKS: dict[str, Callable[[nn.Module, list[str]], object]] = {
    "forward": lambda m, seen: m.register_forward_hook(
        lambda mod, args, out: (seen.append("forward"), _scaled(out, 1.5))[1]
    ),
    "forward with kwargs": lambda m, seen: m.register_forward_hook(
        lambda mod, args, kwargs, out: (seen.append("forward"), _scaled(out, 1.5))[1],
        with_kwargs=True,
    ),
    "pre": lambda m, seen: m.register_forward_pre_hook(
        lambda mod, args: (seen.append("pre"), _first_scaled(args, 1.25))[1]
    ),
    "pre with kwargs": lambda m, seen: m.register_forward_pre_hook(
        lambda mod, args, kwargs: (seen.append("pre"), None)[1], with_kwargs=True
    ),
    "full backward": lambda m, seen: m.register_full_backward_hook(
        lambda mod, gin, gout: (
            seen.append("backward"),
            tuple(None if g is None else g * 2 for g in gin),
        )[1]
    ),
    "full backward pre": lambda m, seen: m.register_full_backward_pre_hook(
        lambda mod, gout: (seen.append("backward"), tuple(g * 0.5 for g in gout))[1]
    ),
}
ADOPTED_LAYERS = [
    (family, path, hook)
    for family in FAMILIES
    for path in (("model.norm", "model.layers.0.mlp", "") if family in GATING else ("",))
    for hook in HOOKS
    # The head is called with keyword arguments only: its hooks see no positional tensors.
    if path or hook in ("forward", "pre with kwargs")
]


@pytest.mark.parametrize(("family", "path", "hook"), ADOPTED_LAYERS)
def test_hooks_on_an_adopted_layer_run_around_the_replacement(family, path, hook):
    p = pair(family)
    seen: dict[str, list[str]] = {"stock": [], "adopted": []}
    HOOKS[hook](module(p.stock, path), seen["stock"])
    HOOKS[hook](module(p.adopted, path), seen["adopted"])
    out = compare(p)
    assert seen["adopted"] == seen["stock"] and seen["stock"], seen
    assert out.fallbacks == []
    op = {"model.norm": "rms_norm", "model.layers.0.mlp": GATING.get(family), "": None}[path]
    assert out.calls.get(op or "linear_cross_entropy", 0) >= 1, out.calls


# ---- changes that invalidate a replacement: the model's own forward, and one warning ----------


def _instance_forward(m: nn.Module, seen: list[str]) -> None:
    # What accelerate's hooks do: a forward set on the instance, around the class's.
    cls_forward = type(m).forward

    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append("instance forward")
        return cls_forward(m, *args, **kwargs) * 1.5

    m.forward = forward


CHILD_HOOKS = {**HOOKS, "forward on the instance": _instance_forward}
CHILD_REASON = {
    "forward": "{} has forward hooks",
    "forward with kwargs": "{} has forward hooks",
    "pre": "{} has forward hooks",
    "pre with kwargs": "{} has forward hooks",
    "full backward": "{} has backward hooks",
    "full backward pre": "{} has backward hooks",
    "forward on the instance": "{}.forward is set on the instance",
}
BYPASSED = [
    (family, parent, child, hook)
    for family in FAMILIES
    for parent, child in (
        (("model.layers.0.mlp", ACTIVATION[family]),) if family in ACTIVATION else ()
    )
    + (("", "lm_head"),)
    for hook in CHILD_HOOKS
]


@pytest.mark.parametrize(("family", "parent", "child", "hook"), BYPASSED)
def test_hooks_on_a_bypassed_child_make_the_layer_run_its_own_forward(family, parent, child, hook):
    p = pair(family)
    seen: dict[str, list[str]] = {"stock": [], "adopted": []}
    for name in ("stock", "adopted"):
        CHILD_HOOKS[hook](module(getattr(p, name), parent).get_submodule(child), seen[name])
    out = compare(p)
    assert seen["adopted"] == seen["stock"] and seen["stock"], seen
    (warning,) = out.fallbacks
    assert warning.startswith(f"torchgraft: {parent or '<model>'} (")
    assert warning.endswith(f"runs the model's own forward: {CHILD_REASON[hook].format(child)}")


GLOBAL_HOOKS = {
    "forward": (
        lambda targets: nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 1.5 if id(m) in targets else None
        ),
        "global module forward hooks are set",
    ),
    "forward with kwargs": (
        lambda targets: nn.modules.module.register_module_forward_hook(
            lambda m, args, kwargs, out: out * 1.5 if id(m) in targets else None,
            with_kwargs=True,
        ),
        "global module forward hooks are set",
    ),
    "pre": (
        lambda targets: nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: _first_scaled(args, 1.25) if id(m) in targets else None
        ),
        "global module forward hooks are set",
    ),
    "full backward": (
        lambda targets: nn.modules.module.register_module_full_backward_hook(
            lambda m, gin, gout: (
                tuple(None if g is None else g * 2 for g in gin) if id(m) in targets else None
            )
        ),
        "global module backward hooks are set",
    ),
    "full backward pre": (
        lambda targets: nn.modules.module.register_module_full_backward_pre_hook(
            lambda m, gout: tuple(g * 0.5 for g in gout) if id(m) in targets else None
        ),
        "global module backward hooks are set",
    ),
}


@pytest.mark.parametrize("kind", GLOBAL_HOOKS)
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_global_module_hooks_make_bypassing_layers_run_their_own_forward(family, kind):
    p = pair(family)
    bypassed = [("", "lm_head")]
    if family in ACTIVATION:
        bypassed.append(("model.layers.0.mlp", ACTIVATION[family]))
    targets = {
        id(module(m, parent).get_submodule(child))
        for m in (p.stock, p.adopted)
        for parent, child in bypassed
    }
    register, reason = GLOBAL_HOOKS[kind]
    handle = register(targets)
    try:
        out = compare(p)
    finally:
        handle.remove()
    layers = {w.split(" (")[0].removeprefix("torchgraft: ") for w in out.fallbacks}
    mlps = {"model.layers.0.mlp", "model.layers.1.mlp"} if family in ACTIVATION else set()
    assert layers == {"<model>"} | mlps, out.fallbacks
    assert all(w.endswith(reason) for w in out.fallbacks)
    if family in ACTIVATION:
        assert out.calls["rms_norm"] >= 1  # norms bypass nothing: they keep running the kernel
    assert compare(p).calls["linear_cross_entropy"] == 1  # hooks gone: fused again


# ---- peft LoRA, a custom loss, parametrizations ---------------------------------------------


LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


@pytest.mark.parametrize("targets", ["every linear and lm_head", "lm_head only"])
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora(family, targets):
    peft = pytest.importorskip("peft")
    p = pair(family)
    modules = (LORA_TARGETS[family] if targets != "lm_head only" else []) + ["lm_head"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False)
    p.apply(lambda m: peft.get_peft_model(m, config))
    out = compare(p)
    assert any("lm_head is now" in w for w in out.fallbacks), out.fallbacks
    _, grads = step(p.adopted, seed=3)
    lora_head = [n for n in grads if "lm_head.lora_" in n]
    assert len(lora_head) == 2 and all(grads[n].abs().sum() > 0 for n in lora_head)
    if targets != "lm_head only" and family in GATING:
        assert out.calls[GATING[family]] >= 1  # LoRA'd projections: the MLP still fused


def test_a_custom_loss_function_set_after_adopt_is_used():
    p = pair("llama")

    def my_loss(logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) + 10

    p.apply(lambda m: setattr(m, "loss_function", my_loss))
    out = compare(p)
    assert [w.split(": ", 2)[-1] for w in out.fallbacks] == [
        "loss_function is test_a_custom_loss_function_set_after_adopt_is_used.<locals>.my_loss, "
        "not ForCausalLMLoss"
    ]


class _Scale(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 1.25


@pytest.mark.parametrize(
    ("family", "path"),
    [
        ("llama", "model.norm"),
        ("gemma", "model.norm"),
        ("llama", "lm_head"),
        ("gpt_neox", "lm_head"),
    ],
)
def test_a_parametrized_weight(family, path):
    p = pair(family)

    def scaled(m: nn.Module) -> None:
        parametrize.register_parametrization(m.get_submodule(path), "weight", _Scale())

    p.apply(scaled)
    out = compare(p)
    where = path if path != "lm_head" else "<model>"
    (warning,) = [w for w in out.fallbacks if w.startswith(f"torchgraft: {where} (")]
    assert "Parametrized" in warning


# ---- dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tol"),
    # float64: stock's loss upcasts the logits with .float(), i.e. rounds them to float32.
    [(torch.float64, 1e-6), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)],
    ids=["double", "bfloat16", "half"],
)
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_to_dtype_after_adopt(family, dtype, tol):
    p = pair(family)
    p.apply(lambda m: m.half() if dtype == torch.float16 else m.to(dtype))
    out = compare(p, tol=tol)
    if dtype == torch.float64:
        # RMSNorm was verified on float32/bfloat16/float16 inputs only.
        assert any("input float64 with weight float64 was not verified" in w for w in out.fallbacks)
    else:
        assert out.fallbacks == [] and out.calls["rms_norm"] >= 1


# ---- swapped modules, a patched class ---------------------------------------------------------


SWAPS: dict[str, tuple[Callable[[nn.Module], None], str]] = {
    "act_fn replaced by GELU": (
        lambda m: setattr(m.model.layers[0].mlp, "act_fn", nn.GELU()),
        "act_fn is now GELU, not SiLUActivation",
    ),
    "lm_head replaced by a fresh Linear": (
        lambda m: setattr(m, "lm_head", nn.Linear(32, VOCAB, bias=False)),
        "",  # still a plain Linear: the fused head reads its weight
    ),
    "gate_proj replaced by a fresh Linear": (
        lambda m: setattr(m.model.layers[0].mlp, "gate_proj", nn.Linear(32, 48, bias=False)),
        "",
    ),
    "a norm replaced by a fresh one": (
        lambda m: setattr(m.model, "norm", type(m.model.norm)(32, eps=1e-5)),
        "",  # the new norm is plain, not adopted
    ),
}


@pytest.mark.parametrize("swap", SWAPS)
def test_swapped_submodules(swap):
    change, reason = SWAPS[swap]
    p = pair("llama")
    p.apply(change)
    out = compare(p)
    assert [w.split(": ", 2)[-1] for w in out.fallbacks] == ([reason] if reason else [])


def test_gelu_approximation_changed_in_place():
    p = pair("gemma")
    exact = lambda x: F.gelu(x)  # noqa: E731

    def exact_gelu(m: nn.Module) -> None:
        for layer in m.model.layers:
            layer.mlp.act_fn.act = exact

    p.apply(exact_gelu)
    out = compare(p)
    assert len(out.fallbacks) == 2 and all("act_fn.act changed" in w for w in out.fallbacks)


def test_a_patched_class_forward(monkeypatch):
    p = pair("llama")
    cls = type(p.stock.model.norm)
    own = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: own(self, x) * 1.5)
    out = compare(p)
    assert len(out.fallbacks) == 5
    assert all(
        w.endswith("LlamaRMSNorm.forward was replaced after adoption") for w in out.fallbacks
    )


# ---- copies and pickles -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_deepcopy_is_adopted_and_outlives_the_original(family):
    p = pair(family, fresh=True)
    pymod = sys.modules[type(p.adopted).__module__]
    clone = copy.deepcopy(p.adopted)
    assert torchgraft.unadopt(p.adopted) == 10
    p.adopted = clone
    out = compare(p)
    assert out.fallbacks == []
    assert out.calls["rope"] == 2 and out.calls["rms_norm"] == 5
    assert out.calls["linear_cross_entropy"] == 1
    # The copy held the process-wide RoPE on its own, and lets go of it on its own.
    assert isinstance(pymod.apply_rotary_pos_emb, GuardedFunction)
    assert torchgraft.unadopt(clone) == 10
    assert not isinstance(pymod.apply_rotary_pos_emb, GuardedFunction)


def test_a_copy_changed_after_the_fact_falls_back_alone():
    p = pair("llama")
    clone = copy.deepcopy(p.adopted)
    clone.lm_head.register_forward_hook(lambda *a: None)
    out = compare(p)
    assert out.fallbacks == [] and out.calls["linear_cross_entropy"] == 1
    with pytest.warns(AdoptionFallbackWarning, match="lm_head has forward hooks"):
        step(clone, seed=1)


def _without_kernel_funcs(model: nn.Module) -> None:
    # With the kernels package installed, transformers' attention layers keep hub function
    # holders (local classes) that no pickle takes, adopted or not.
    for m in model.modules():
        if "_kernel_funcs" in vars(m):
            m._kernel_funcs = {}


def test_pickle_gives_a_plain_model():
    p = pair("llama", fresh=True)
    p.apply(_without_kernel_funcs)
    blob = pickle.dumps(p.adopted)
    torchgraft.unadopt(p.adopted)  # the process-wide RoPE goes back with the last holder
    p.adopted = pickle.loads(blob)
    assert not getattr(p.adopted, "_torchgraft_adoption", None)
    out = compare(p)
    assert out.fallbacks == [] and sum(out.calls.values()) == 0, out.calls
    # Plain: it can be adopted again.
    assert torchgraft.adopt(p.adopted).count() == 10


# ---- the switches -----------------------------------------------------------------------------


@pytest.mark.parametrize("switch", ["disable()", "with disabled()"])
def test_switched_off_gives_exactly_stock_and_no_kernel_runs(switch):
    p = pair("llama")
    with torchgraft.disabled():
        ref_loss, ref_grads = step(p.stock, seed=5)
    torchgraft.reset_stats()
    if switch == "disable()":
        torchgraft.disable()
        loss, grads = step(p.adopted, seed=5)
        torchgraft.enable()
    else:
        with torchgraft.disabled():
            loss, grads = step(p.adopted, seed=5)
    assert all(v["calls"] == 0 for v in torchgraft.stats().values())
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert compare(p).calls["swiglu"] == 2  # on again: the kernels run


def test_an_op_switched_off_runs_the_models_own_code():
    p = pair("llama")
    with torchgraft.backends.operations_disabled("swiglu", "rope"):
        out = compare(p)
    assert out.fallbacks == []
    assert out.calls.get("swiglu", 0) == 0 and out.calls.get("rope", 0) == 0
    assert out.calls["rms_norm"] == 5 and out.calls["linear_cross_entropy"] == 1
    assert compare(p).calls["swiglu"] == 2


def test_the_kill_switch_adopts_nothing(monkeypatch):
    monkeypatch.setenv(control.DISABLE_ENV, "1")
    model = tiny_model("llama")
    report = torchgraft.adopt(model)
    assert report.rows and all((r.status, r.reason) == (SKIPPED, KILLED) for r in report.rows)
    assert "kill switch" in report.table().splitlines()[0]
    assert not getattr(model, "_torchgraft_adoption", None)
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_report_says_when_torchgraft_is_not_enabled():
    model = tiny_model("llama")
    with switched(False):
        report = torchgraft.adopt(model)
        assert "torchgraft is not enabled" in report.table()
    assert "torchgraft is not enabled" not in report.table()


# ---- the warning, once per layer and reason ---------------------------------------------------


def test_the_fallback_warning_is_given_once_per_layer_and_reason():
    p = pair("llama")
    for layer in p.adopted.model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda *a: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            step(p.adopted, seed)
        p.adopted.lm_head.register_forward_pre_hook(lambda *a: None)
        p.adopted.loss_function = lambda *a, **k: torch.tensor(0.0, requires_grad=True)
        for seed in range(3):
            step(p.adopted, seed)
    messages = [str(w.message) for w in caught if w.category is AdoptionFallbackWarning]
    assert sorted(messages) == [
        "torchgraft: <model> (LlamaForCausalLM) runs the model's own forward: lm_head has "
        "forward hooks",
        "torchgraft: model.layers.0.mlp (LlamaMLP) runs the model's own forward: act_fn has "
        "forward hooks",
        "torchgraft: model.layers.1.mlp (LlamaMLP) runs the model's own forward: act_fn has "
        "forward hooks",
    ]


# ---- partial rotary -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_partial_rotary_runs_the_rope_kernel(family):
    p = pair(family)
    other = tiny_model(family, **CONFIG[family])
    (row,) = [r for r in torchgraft.adopt(other).rows if r.kind == "rope"]
    assert row.status == ADOPTED and "partial rotary too" in row.reason
    out = compare(p)
    assert out.calls["rope"] == 2 and out.calls["rope_backward"] == 2


def test_partial_rotary_the_op_does_not_compute_is_reported_not_adopted(monkeypatch):
    from adopt_helpers import contract_module, use_functional

    _release("gpt_neox")  # no adopted model holds the family's RoPE: it is verified anew
    use_functional(monkeypatch, contract_module())  # its rope rotates whole heads only
    report = torchgraft.adopt(tiny_model("gpt_neox", **CONFIG["gpt_neox"]))
    (row,) = [r for r in report.rows if r.kind == "rope"]
    assert row.status == SKIPPED and "no variant matches" in row.reason, row


def test_a_global_someone_else_replaced_is_never_overwritten():
    p = pair("llama", fresh=True)
    pymod = sys.modules[type(p.adopted).__module__]
    own = pymod.apply_rotary_pos_emb

    def theirs(q, k, cos, sin, unsqueeze_dim=1):
        return own.own(q, k, cos, sin, unsqueeze_dim)

    pymod.apply_rotary_pos_emb = theirs
    try:
        (row,) = [r for r in torchgraft.adopt(tiny_model("llama", seed=2)).rows if r.kind == "rope"]
        assert row.status == SKIPPED and "replaced by someone else" in row.reason
        assert pymod.apply_rotary_pos_emb is theirs
        torchgraft.unadopt(p.adopted)
        assert pymod.apply_rotary_pos_emb is theirs
    finally:  # as adoption left it: the replacement while another model holds it
        held = slots.held_global(pymod, "apply_rotary_pos_emb")
        pymod.apply_rotary_pos_emb = held[1] if held else own.own


# ---- torch.compile ----------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama import modeling_llama as ml

        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48)
        self.norm = ml.LlamaRMSNorm(32)
        self.mlp = ml.LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.compat
def test_guarded_layers_compile_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    stock = _Block()
    block = copy.deepcopy(stock)
    report = torchgraft.adopt(block)
    assert report.count("rms_norm") == report.count("gated_mlp") == 1
    x = torch.randn(2, 5, 32, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for on in (True, False, True):
        with switched(on):
            torchgraft.reset_stats()
            out = compiled(x)
            assert rel_err(out, stock(x)) <= TOL
            ran = torchgraft.stats()["native/torchgraft::swiglu/CPU"]["calls"]
            assert ran == int(on)
    # A hook on the bypassed activation, added after compiling: torch's compiled stock model
    # keeps running the graph it traced (dynamo skips module hook guards by default); the
    # adopted one does the same or, where dynamo guards the guard's read of the hooks (2.15),
    # runs the model's own code with the hook. Either way it computes what some stock model
    # computes, never a mix.
    compiled_stock = torch.compile(stock, backend="eager", fullgraph=True)
    without_hook = compiled_stock(x)
    block.mlp.act_fn.register_forward_hook(lambda m, a, out: out * 2)
    stock.mlp.act_fn.register_forward_hook(lambda m, a, out: out * 2)
    with_hook = stock(x)
    assert rel_err(with_hook, without_hook) > 0.01  # the hook changes the result
    out = compiled(x)
    assert min(rel_err(out, with_hook), rel_err(out, compiled_stock(x))) <= TOL
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
