"""``torchgraft bench model``: the tiny model end to end on the CPU, and its honesty checks.

The run through the CLI checks the JSON's structure and what it claims: stock run twice from
the same seed gives the same losses exactly, variants that run with torchgraft off show no graft
calls, and every variant leaves the process as it found it. Liger-Kernel needs a GPU; its
integration (global patches caught, undone, and applied only around its own steps) is checked
with a stand-in that patches the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import cli, native
from torchgraft.bench import model, model_variants, model_zoo, patches, timing
from torchgraft.bench.model_variants import VARIANTS, Prepared, Setting, Variant

pytestmark = pytest.mark.default_torch

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

NATIVE = pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")
TINY = model_zoo.SIZES["tiny"]
MOE_TINY = model_zoo.MOE_SIZES["tiny"]
FAST = ("--rounds", "2", "--steps", "2", "--warmup", "1", "--threads", "1")


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady timings on a shared 2-core machine
    yield
    torchgraft.disable()
    torch.set_num_threads(threads)


def _tiny_config(variants: list[str], **overrides: object) -> model.ModelBenchConfig:
    settings: dict = {"rounds": 2, "steps": 2, "warmup": 1, "loss_steps": 8, "profile": False}
    settings.update(overrides)
    return model.ModelBenchConfig(
        size="tiny", family="llama", device=CPU, dtype=torch.float32, variants=variants, **settings
    )


def _steps_per_variant(config: model.ModelBenchConfig) -> int:
    # loss steps, every round's warm-up and timed steps, then one warm and one counted step
    # (plus one profiled step when profiling).
    timed = config.rounds * (config.warmup + config.steps)
    return config.loss_steps + timed + 2 + (1 if config.profile else 0)


def _with_variant(monkeypatch: pytest.MonkeyPatch, variant: Variant) -> None:
    monkeypatch.setitem(VARIANTS, variant.name, variant)


# ---- the tiny model through the CLI -------------------------------------------------------------


def test_tiny_run_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A first build fills transformers' lazy class attributes; then nothing may change.
    model_zoo.build_model(
        model_zoo.build_config(TINY, model_zoo.FAMILIES["llama"]), CPU, torch.float32, 0
    )
    watched = patches.Snapshot(
        patches.namespaces_for([*model_variants.WATCHED_MODULES, modeling_llama.__name__])
    )
    names = ["stock", "stock-again", "torchgraft", "compile", "compile+torchgraft"]
    args = ["bench", "model", "--size", "tiny", "--device", "cpu", *FAST]
    args += ["--variants", ",".join(names[1:]), "--compile-backend", "aot_eager"]
    status = cli.main([*args, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    stem = "model_tiny_llama_cpu_fp32"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == PNG_MAGIC
    assert "| stock-again |" in (tmp_path / f"{stem}.md").read_text()
    assert "stock-again" in out and "checks: all passed" in out

    # The run as configured.
    assert data["benchmark"] == "model" and data["family"] == "llama"
    assert data["size"] == TINY.to_json()
    assert data["tokens_per_step"] == TINY.batch * TINY.seq
    assert (data["rounds"], data["steps"], data["warmup"], data["loss_steps"]) == (2, 2, 1, 50)
    assert data["optimizer"].startswith("AdamW(")
    assert data["versions"]["torch"] == torch.__version__ and data["versions"]["transformers"]
    assert data["command"].startswith("torchgraft bench model ")
    assert data["idle_variants"] == "in memory (CPU)" and data["parameters"] > 0
    assert data["flops_per_step"] == model_zoo.flops_per_step(TINY, data["parameters"])
    assert data["peak_tflops"] is None  # no MFU on the CPU
    # stock runs although not named; the variants not asked for are listed with the reason.
    assert [v["name"] for v in data["variants"]] == names
    skipped = {s["name"]: s["reason"] for s in data["skipped"]}
    assert set(skipped) == set(VARIANTS) - set(names)
    assert all(reason.startswith("not selected") for reason in skipped.values())

    stock = data["variants"][0]
    for v in data["variants"]:
        assert v["error"] is None and v["state_problems"] == []
        assert len(v["round_ms"]) == 2 and all(t > 0 for t in v["round_ms"])
        assert v["ms_per_step"] == statistics.median(v["round_ms"])
        assert math.isclose(v["tokens_per_s"], TINY.tokens / (v["ms_per_step"] / 1e3))
        assert math.isclose(v["speedup_vs_stock"], stock["ms_per_step"] / v["ms_per_step"])
        assert v["peak_gib"] is None and v["resident_gib"] is None  # not measured on the CPU
        assert v["mfu"] is None
        assert len(v["losses"]) == 50 and all(math.isfinite(x) for x in v["losses"])
        diffs = [abs(a - b) for a, b in zip(v["losses"], stock["losses"], strict=True)]
        assert v["max_abs_loss_diff_vs_stock"] == max(diffs)
        assert v["graphs_compiled_while_timed"] == 0
        assert v["graph_breaks"] == 0 or "compile" not in v["name"], v["name"]
        profile = v["profile"]
        assert profile["clock"] == "self CPU time" and profile["total_ms"] > 0
        assert 0 < len(profile["ops"]) <= 20
        times = [op["self_ms"] for op in profile["ops"]]
        assert times == sorted(times, reverse=True) and sum(times) <= profile["total_ms"] * 1.0001
        assert any(op["op"] == "aten::mm" for op in profile["ops"])
    # The losses move (the model learns its four batches), and stock repeats itself exactly.
    assert stock["losses"][-1] < stock["losses"][0] - 0.1
    assert data["variants"][1]["max_abs_loss_diff_vs_stock"] == 0.0
    assert data["checks"] == {
        "no_grafts_with_torchgraft_off": True,
        "state_restored_after_every_variant": True,
        "losses_finite": True,
        "no_recompiles_while_timed": True,
        "no_graph_breaks_in_compiled_torchgraft": True,
        "stock_again_max_abs_loss_diff": 0.0,
    }
    for v in data["variants"][2:]:
        if "torchgraft" in v["name"]:
            rows = v["notes"]["adoption"]["rows"]
            assert any(r["kind"] == "rms_norm" and r["status"] == "adopted" for r in rows), rows
        if "compile" in v["name"]:
            assert v["notes"]["compile_backend"] == "aot_eager"
    # The first compiled variant compiled its graphs in the loss steps, not while timed.
    assert data["variants"][3]["notes"]["graphs_compiled_in_loss_steps"] >= 1
    # Stock variants never ran a graft.
    for v in data["variants"][:2] + data["variants"][3:4]:
        assert v["grafts_during_losses"] == {} and v["grafts_per_step"] == {}
    # The process is as before: torchgraft off, no module attribute changed.
    assert not torchgraft.is_enabled()
    assert watched.changes() == []


# ---- isolation: Liger-style global patches, leaks, failures -------------------------------------


class _Counter:
    """Wraps a function and counts its calls."""

    def __init__(self, fn: object) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.fn(*args, **kwargs)  # type: ignore[operator]


def _fake_liger(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Counter]:
    """A ``liger_kernel`` whose apply function patches what Liger's does, numerically exact."""
    counters: dict[str, _Counter] = {}

    def apply_liger_kernel_to_llama(
        model: torch.nn.Module,
        cross_entropy: bool = False,
        fused_linear_cross_entropy: bool = True,
        **_: object,
    ) -> None:
        counters["rope"] = _Counter(modeling_llama.apply_rotary_pos_emb)
        modeling_llama.apply_rotary_pos_emb = counters["rope"]  # read at call time
        modeling_llama.LlamaRMSNorm = type("FakeLigerRMSNorm", (modeling_llama.LlamaRMSNorm,), {})
        if cross_entropy:
            counters["ce"] = _Counter(F.cross_entropy)
            torch.nn.functional.cross_entropy = counters["ce"]
        norm = model.model.norm  # an instance patch, as Liger's _patch_rms_norm_module
        norm.forward = types.MethodType(type(norm).forward, norm)

    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama  # type: ignore[attr-defined]
    package = types.ModuleType("liger_kernel")
    transformers_package = types.ModuleType("liger_kernel.transformers")
    transformers_package.monkey_patch = monkey_patch  # type: ignore[attr-defined]
    package.transformers = transformers_package  # type: ignore[attr-defined]
    for name, module in (
        ("liger_kernel", package),
        ("liger_kernel.transformers", transformers_package),
        ("liger_kernel.transformers.monkey_patch", monkey_patch),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("liger-flce", "liger-ce"):
        _with_variant(monkeypatch, dataclasses.replace(VARIANTS[name], unavailable=lambda _: None))
    return counters


def test_liger_global_patches_apply_around_its_own_steps_only(monkeypatch):
    counters = _fake_liger(monkeypatch)
    rope, rms_norm_class, ce = (
        modeling_llama.apply_rotary_pos_emb,
        modeling_llama.LlamaRMSNorm,
        torch.nn.functional.cross_entropy,
    )
    config = _tiny_config(["stock", "liger-ce", "stock-again"])
    report = model.run(config)
    assert report.failed() == []
    # Put back: the module globals and torch.nn.functional are stock again.
    assert modeling_llama.apply_rotary_pos_emb is rope
    assert modeling_llama.LlamaRMSNorm is rms_norm_class
    assert torch.nn.functional.cross_entropy is ce
    liger = report.result("liger-ce")
    assert liger is not None
    assert sorted(liger.notes["global_patches"]) == [
        "torch.nn.functional.cross_entropy",
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
    ]
    assert "cross_entropy=True" in liger.notes["liger_function"]
    # Only Liger's own steps saw the patches: stock-again, which ran after Liger was applied,
    # between Liger's rounds, never called them.
    steps = _steps_per_variant(config)
    assert counters["rope"].calls == steps * TINY.layers
    assert counters["ce"].calls == steps
    assert liger.max_abs_loss_diff_vs_stock == 0.0
    assert report.checks["state_restored_after_every_variant"] is True


def test_liger_variants_need_a_gpu_and_the_package(monkeypatch, capsys):
    monkeypatch.setattr(model_variants, "module_available", lambda name: name != "liger_kernel")
    setting = Setting(CPU, "llama")
    assert "not installed" in (VARIANTS["liger-flce"].unavailable(setting) or "")
    monkeypatch.setattr(model_variants, "module_available", lambda name: True)
    assert "CUDA" in (VARIANTS["liger-ce"].unavailable(setting) or "")
    status = cli.main(["bench", "model", "--device", "cpu", "--variants", "liger-ce"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip().count("\n") == 0
    assert "variant 'liger-ce' cannot run on cpu: Liger-Kernel's Triton kernels" in err


def _leaky(model_: torch.nn.Module, _setting: Setting) -> Prepared:
    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = _Counter(original)  # never put back

    def undo() -> None:
        modeling_llama.apply_rotary_pos_emb = original

    return Prepared(call=model_, active=torchgraft.enabled, undo=undo)


def test_a_variant_that_leaks_global_state_fails_the_run(monkeypatch, tmp_path, capsys):
    rope = modeling_llama.apply_rotary_pos_emb
    leaky = Variant("leaky", "patches a global", lambda _: None, _leaky, grafts=True)
    _with_variant(monkeypatch, leaky)
    try:
        args = ["--variants", "leaky", "--loss-steps", "4", "--no-profile", "--no-plot"]
        status = cli.main(
            ["bench", "model", "--device", "cpu", *FAST, *args, "--out", str(tmp_path)]
        )
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
    captured = capsys.readouterr()
    assert status == 1
    data = json.loads((tmp_path / "model_tiny_llama_cpu_fp32.json").read_text())
    leaked = data["variants"][1]
    assert leaked["name"] == "leaky"
    assert (
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb changed"
        in (leaked["state_problems"])
    )
    assert data["checks"]["state_restored_after_every_variant"] is False
    assert data["variants"][0]["state_problems"] == []  # stock ran before the leak
    assert "NOT RESTORED" in captured.out and "leaky" in captured.err


def _unrestored_model(model_: torch.nn.Module, _setting: Setting) -> Prepared:
    norm = model_.model.norm
    norm.forward = types.MethodType(type(norm).forward, norm)  # an undo that forgets it
    return Prepared(call=model_, active=contextlib.nullcontext)


def test_an_undo_that_leaves_the_model_changed_is_caught(monkeypatch):
    variant = Variant("sticky", "swaps a forward", lambda _: None, _unrestored_model, grafts=False)
    _with_variant(monkeypatch, variant)
    report = model.run(_tiny_config(["sticky"]))
    sticky = report.result("sticky")
    assert sticky is not None and sticky.state_problems == ["the model's modules were not restored"]
    assert report.failed()


class _Flaky:
    """A model call that raises after ``good`` calls."""

    def __init__(self, model_: torch.nn.Module, good: int) -> None:
        self.model = model_
        self.good = good

    def __call__(self, **kwargs: object) -> object:
        self.good -= 1
        if self.good < 0:
            raise RuntimeError("kernel exploded\nsecond line")
        return self.model(**kwargs)


def test_a_variant_failing_mid_run_is_reported_and_the_others_finish(monkeypatch, capsys):
    loss_steps = 4
    flaky = Variant(
        "flaky",
        "fails while timed",
        lambda _: None,
        lambda m, _s: Prepared(call=_Flaky(m, loss_steps + 1), active=contextlib.nullcontext),
        grafts=False,
    )
    _with_variant(monkeypatch, flaky)
    report = model.run(_tiny_config(["flaky", "stock-again"], loss_steps=loss_steps))
    broken, again = report.result("flaky"), report.result("stock-again")
    assert broken is not None and again is not None
    assert broken.error == "RuntimeError: kernel exploded"
    assert broken.ms_per_step is None and len(broken.losses) == loss_steps
    assert again.error is None and again.ms_per_step is not None and again.profile is None
    assert report.failed() == ["flaky: RuntimeError: kernel exploded"]


@NATIVE
def test_graft_calls_are_counted_and_must_not_happen_with_torchgraft_off(monkeypatch):
    """A variant that routes the final norm to F.rms_norm (as adopt() does) with torchgraft on:
    its grafts are counted per step; claiming it runs with torchgraft off fails the check."""

    def prepare(model_: torch.nn.Module, _setting: Setting) -> Prepared:
        norm = model_.model.norm

        def forward(x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, [x.shape[-1]], norm.weight, norm.variance_epsilon)

        norm.forward = forward
        return Prepared(
            call=model_, active=torchgraft.enabled, undo=lambda: vars(norm).pop("forward")
        )

    for grafts in (True, False):
        _with_variant(monkeypatch, Variant("routed", "F.rms_norm", lambda _: None, prepare, grafts))
        report = model.run(_tiny_config(["routed"]))
        routed = report.result("routed")
        assert routed is not None and routed.error is None and routed.state_problems == []
        expected = {
            "native/aten::_fused_rms_norm/CPU": {"calls": 1, "fallbacks": 0},
            "native/aten::_fused_rms_norm_backward/CPU": {"calls": 1, "fallbacks": 0},
            # The loss: cross-entropy through aten::_log_softmax and its backward.
            "native/aten::_log_softmax/CPU": {"calls": 1, "fallbacks": 0},
            "native/aten::_log_softmax_backward_data/CPU": {"calls": 1, "fallbacks": 0},
        }
        if "fused=True" in report.optimizer:
            # The fused optimizer step is grafted too (aten::_fused_adamw_).
            expected["native/aten::_fused_adamw_/CPU"] = {"calls": 1, "fallbacks": 0}
        assert routed.grafts_per_step == expected
        assert routed.grafts_during_losses["native/aten::_fused_rms_norm/CPU"]["calls"] == 8
        assert report.checks["no_grafts_with_torchgraft_off"] is grafts
        assert not torchgraft.is_enabled()


# ---- pieces -------------------------------------------------------------------------------------


def test_usage_errors_exit_2_with_one_line(capsys):
    for args, fragment in (
        (["--variants", "stock,nope"], "unknown variant 'nope'; known: stock, stock-again"),
        (["--size", "huge"], "invalid choice: 'huge'"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--dtype", "fp16"], "bf16 or fp32"),
        (["--variants", ","], "empty list"),
        (["--family", "mixtral", "--size", "1b"], "family 'mixtral' has no size '1b'; its sizes"),
        (["--experts-implementation", "eager"], "is for the MoE families (qwen3moe, mixtral, "),
        (["--family", "olmoe", "--experts-implementation", "fast"], "invalid choice: 'fast'"),
    ):
        status = cli.main(["bench", "model", "--device", "cpu", *args])
        err = capsys.readouterr().err
        assert status == 2, args
        assert err.startswith("torchgraft: error: ") and err.count("\n") == 1, err
        assert fragment in err, err
    assert cli.main(["bench", "--device", "cpu", "model"]) == 2
    assert "put the options after 'model'" in capsys.readouterr().err


def test_help_lists_sizes_families_and_variants(capsys):
    assert cli.main(["bench", "model", "--help"]) == 0
    out = capsys.readouterr().out
    words = [*model_zoo.SIZES, *model_zoo.FAMILIES, *VARIANTS, *model_zoo.EXPERTS_IMPLEMENTATIONS]
    for word in [*words, "--experts-implementation"]:
        assert word in out


def test_sizes_have_the_shapes_of_the_issue():
    """``1b`` is Llama-3.2-1B's shape: its published parameter count (1,235,814,400)."""
    counts = {}
    for size in ("small", "1b"):
        for family in model_zoo.FAMILIES:
            config = model_zoo.build_config(model_zoo.SIZES[size], model_zoo.FAMILIES[family])
            built = model_zoo.build_model(config, torch.device("meta"), torch.bfloat16, 0)
            assert type(built).__name__.lower().startswith(family)
            assert built.config.tie_word_embeddings is model_zoo.SIZES[size].tied
            counts[size, family] = sum(p.numel() for p in built.parameters())
    assert counts["1b", "llama"] == 1_235_814_400
    # The FLOPs the issue counts for the 1b step (67.3 TFLOP, causal attention included).
    assert (
        abs(model_zoo.flops_per_step(model_zoo.SIZES["1b"], counts["1b", "llama"]) - 67.34e12)
        < 0.01e12
    )
    # small: embeddings and untied head 2 x 32000 x 2048, 8 layers of attention (q, o: 2048^2;
    # k, v: 2048 x 1024) and MLP (3 x 2048 x 5632), 17 norms of 2048.
    layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632 + 2 * 2048
    assert counts["small", "llama"] == 2 * 32000 * 2048 + 8 * layer + 2048


def test_moe_sizes_have_the_shapes_of_the_issue_and_count_active_parameters():
    """``small``: Qwen3-30B-A3B's layers (hidden 2048, 16 / 4 heads of 128, 64 experts of 768,
    top-8, vocab 151936, untied); Mixtral's top-2 of 8 experts of 3072 meets as many expert
    weights per token. The counts and the step's FLOPs are computed here by hand."""
    counts = {}
    for name in ("qwen3moe", "mixtral", "olmoe"):
        family = model_zoo.FAMILIES[name]
        config = model_zoo.build_config(model_zoo.size_for(family, "small"), family)
        assert config.output_router_logits is True  # the load-balancing loss is in the loss
        assert config._experts_implementation == "grouped_mm"
        built = model_zoo.build_model(config, torch.device("meta"), torch.bfloat16, 0)
        assert type(built).__name__.lower().startswith(name)
        counts[name] = sum(p.numel() for p in built.parameters())
    assert model_zoo.FAMILIES["qwen3moe"].overrides["norm_topk_prob"] is True
    hidden, vocab, layers = 2048, 151936, 8
    attention = 2 * hidden * 2048 + 2 * hidden * 512  # q, o: 16 heads of 128; k, v: 4 heads
    norms = 2 * hidden  # input and post-attention RMSNorm
    embeddings = 2 * vocab * hidden + hidden  # untied, and the final norm
    qwen_layer = attention + 2 * 128 + norms + 64 * hidden + 64 * 3 * hidden * 768
    assert counts["qwen3moe"] == embeddings + layers * qwen_layer  # 3,123.2M
    olmoe_layer = attention + 2048 + 512 + norms + 64 * hidden + 64 * 3 * hidden * 768
    assert counts["olmoe"] == embeddings + layers * olmoe_layer  # q/k norms over all heads
    mixtral_layer = attention + norms + 8 * hidden + 8 * 3 * hidden * 3072
    assert counts["mixtral"] == embeddings + layers * mixtral_layer

    # Active: the 56 experts of each layer the router did not pick stay idle.
    small = model_zoo.MOE_SIZES["small"]
    active = counts["qwen3moe"] - layers * 56 * 3 * hidden * 768
    assert model_zoo.active_parameters(small, counts["qwen3moe"]) == active == 1_009_291_264
    # 6 x (active - input embedding) x 8192 tokens, plus causal attention's 12 L d S / 2 per token.
    flops = 6 * (active - vocab * hidden) * 8192 + 12 * layers * hidden * 4096 * 8192 / 2
    assert model_zoo.flops_per_step(small, counts["qwen3moe"]) == flops
    assert abs(flops - 37.61e12) < 0.01e12
    # Mixtral's small: the same expert weights per token (2 x 3072 = 8 x 768).
    mixtral = model_zoo.MIXTRAL_SIZES["small"]
    mixtral_active = model_zoo.active_parameters(mixtral, counts["mixtral"])
    # It has no q/k norms, and 56 router rows fewer per layer.
    assert mixtral_active == active - layers * (2 * 128 + 56 * hidden)
    # Dense sizes count every parameter.
    assert model_zoo.active_parameters(model_zoo.SIZES["1b"], 1000) == 1000


def test_the_liger_variants_take_the_familys_apply_function(monkeypatch):
    why = VARIANTS["liger-flce"].unavailable(Setting(CPU, "olmoe"))
    assert why == "Liger-Kernel has no integration for olmoe"
    called: list[str] = []
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.apply_liger_kernel_to_qwen3_moe = lambda **_: called.append("qwen3_moe")  # type: ignore[attr-defined]
    package = types.ModuleType("liger_kernel.transformers")
    package.monkey_patch = monkey_patch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package)
    monkeypatch.setitem(sys.modules, monkey_patch.__name__, monkey_patch)
    family = model_zoo.FAMILIES["qwen3moe"]
    built = model_zoo.build_model(
        model_zoo.build_config(model_zoo.MOE_SIZES["tiny"], family), CPU, torch.float32, 0
    )
    prepared = VARIANTS["liger-ce"].prepare(built, Setting(CPU, "qwen3moe"))
    assert called == ["qwen3_moe"]
    function = prepared.notes["liger_function"]
    assert function.startswith("apply_liger_kernel_to_qwen3_moe(model=model")


@NATIVE
@pytest.mark.parametrize(
    ("family", "experts"), [("qwen3moe", None), ("mixtral", "batched_mm"), ("olmoe", "eager")]
)
def test_moe_families_run_through_the_cli_and_adopted_routers_train_like_stock(
    family: str, experts: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny MoE model (4 experts, top-2, the load-balancing loss in the loss) in stock and
    torchgraft: torchgraft's routers (the ``moe_router`` adopter) give stock's losses."""
    args = ["bench", "model", "--family", family, "--device", "cpu", *FAST, "--loss-steps", "6"]
    args += ["--variants", "torchgraft", "--no-profile", "--no-plot", "--out", str(tmp_path)]
    if experts is not None:
        args += ["--experts-implementation", experts]
    status = cli.main(args)
    out, err = capsys.readouterr()
    assert status == 0, err
    implementation = experts or "grouped_mm"
    assert f"active: top-2 of 4 experts of 32, {implementation} experts;" in out.splitlines()[0]
    data = json.loads((tmp_path / f"model_tiny_{family}_cpu_fp32.json").read_text())
    assert data["experts_implementation"] == implementation
    assert data["size"]["experts"] == {"count": 4, "per_token": 2}
    # Per layer, two idle SwiGLU experts of 3 x hidden x 32.
    idle = MOE_TINY.layers * 2 * 3 * MOE_TINY.hidden * MOE_TINY.mlp
    assert data["active_parameters"] == data["parameters"] - idle
    stock, adopted = data["variants"]
    assert [stock["name"], adopted["name"]] == ["stock", "torchgraft"]
    assert all(v["error"] is None and v["state_problems"] == [] for v in data["variants"])
    rows = [r for r in adopted["notes"]["adoption"]["rows"] if r["kind"] == "moe_router"]
    assert len(rows) == MOE_TINY.layers and all(r["status"] == "adopted" for r in rows), rows
    routed = adopted["grafts_per_step"]["native/torchgraft::topk_softmax/CPU"]
    assert routed["calls"] == MOE_TINY.layers
    assert stock["losses"][-1] < stock["losses"][0]
    assert adopted["max_abs_loss_diff_vs_stock"] < 1e-5  # float32
    assert data["checks"]["no_grafts_with_torchgraft_off"] is True


def test_glm4moe_runs_through_the_cli_with_the_sigmoid_router_adopted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GLM-4-MoE with DeepSeek-V3's routing (2 groups of 2 experts at tiny, 1 kept, weights x
    2.5, a shared expert): its routers run ``torchgraft::topk_sigmoid`` and give stock's losses."""
    args = ["bench", "model", "--family", "glm4moe", "--device", "cpu", *FAST, "--loss-steps", "6"]
    args += ["--variants", "torchgraft", "--no-profile", "--no-plot", "--out", str(tmp_path)]
    status = cli.main(args)
    _, err = capsys.readouterr()
    assert status == 0, err
    data = json.loads((tmp_path / "model_tiny_glm4moe_cpu_fp32.json").read_text())
    assert data["size"]["experts"] == {"count": 4, "per_token": 2}
    stock, adopted = data["variants"]
    assert all(v["error"] is None and v["state_problems"] == [] for v in data["variants"])
    rows = [r for r in adopted["notes"]["adoption"]["rows"] if r["kind"] == "moe_router"]
    assert len(rows) == MOE_TINY.layers and all(r["status"] == "adopted" for r in rows), rows
    routed = adopted["grafts_per_step"]["native/torchgraft::topk_sigmoid/CPU"]
    assert routed["calls"] == MOE_TINY.layers
    assert stock["losses"][-1] < stock["losses"][0]
    assert adopted["max_abs_loss_diff_vs_stock"] < 1e-5  # float32


def test_8b_is_llama_3_1_8b():
    """``8b`` has Llama-3.1-8B's published parameter count (8,030,261,248), untied head."""
    size = model_zoo.SIZES["8b"]
    config = model_zoo.build_config(size, model_zoo.FAMILIES["llama"])
    built = model_zoo.build_model(config, torch.device("meta"), torch.bfloat16, 0)
    assert sum(p.numel() for p in built.parameters()) == 8_030_261_248
    assert not built.config.tie_word_embeddings


def test_mfu_peaks_by_gpu_name():
    assert model_zoo.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert model_zoo.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert model_zoo.peak_bf16_tflops("NVIDIA A10G") is None


def test_patches_record_undo_and_apply():
    module = types.ModuleType("fake_modeling")
    module.rope = len  # type: ignore[attr-defined]
    module.gone = abs  # type: ignore[attr-defined]

    class Norm:
        def forward(self) -> int:
            return 1

    Norm.__module__ = module.__name__
    module.Norm = Norm  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        targets = patches.namespaces_for([module.__name__, "not.imported"])
        assert targets == [module, Norm]

        def patch() -> None:
            module.rope = max  # type: ignore[attr-defined]
            del module.gone  # type: ignore[attr-defined]
            module.added = min  # type: ignore[attr-defined]
            module.submodule = types.ModuleType("fake_modeling.sub")  # an import, not a patch
            Norm.forward = lambda self: 2  # type: ignore[method-assign]

        recorded = patches.record(targets, patch)
        assert sorted(patches.where(p) for p in recorded) == [
            "fake_modeling.added",
            "fake_modeling.gone",
            "fake_modeling.rope",
            f"fake_modeling.{Norm.__qualname__}.forward",
        ]
        assert (module.rope, module.gone, Norm().forward()) == (len, abs, 1)
        assert not hasattr(module, "added")
        with patches.applied(recorded):
            assert (module.rope, module.added, Norm().forward()) == (max, min, 2)
            assert not hasattr(module, "gone")
        assert (module.rope, module.gone, Norm().forward()) == (len, abs, 1)
        assert not hasattr(module, "added")
    finally:
        del sys.modules[module.__name__]


def test_alternating_rounds_order_warmup_and_errors():
    log: list[str] = []

    def call(name: str, fail_at: int | None = None) -> Callable[[], None]:
        def run() -> None:
            log.append(name)
            if fail_at is not None and log.count(name) == fail_at:
                raise ValueError(name)

        return run

    entered: list[str] = []
    errors: list[tuple[str, str]] = []

    class Around:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name)

        def __exit__(self, *exc: object) -> None:
            entered.append(f"/{self.name}")

    times = timing.alternating_rounds(
        {"a": call("a"), "b": call("b", fail_at=5), "c": call("c")},
        CPU,
        rounds=2,
        steps=3,
        warmup=1,
        around=Around,
        on_error=lambda name, error: errors.append((name, str(error))),
    )
    assert log == ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["a"] * 4 + ["b"] + ["c"] * 4
    assert entered == ["a", "/a", "b", "/b", "c", "/c", "a", "/a", "b", "/b", "c", "/c"]
    assert errors == [("b", "b")]
    assert [len(times[n]) for n in "abc"] == [2, 1, 2]
    with pytest.raises(ValueError, match="a"):
        timing.alternating_rounds({"a": call("a", fail_at=9)}, CPU, rounds=3, steps=3, warmup=0)


def test_profiling_a_step_prints_nothing_of_the_profilers_own():
    # On a machine without a usable GPU, a CUDA build of torch's profiler wrote
    # "gpuGetDeviceCount failed with code 35" (and USDT/STAGE lines) to stderr.
    import os
    import subprocess

    code = (
        "import torch; from torchgraft.bench.op_profile import profile_step;"
        "x = torch.randn(32, 32); p = profile_step(lambda: x @ x, torch.device('cpu'));"
        "print(p.ops[0].op)"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = str(Path(torchgraft.__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "aten::mm"
    assert result.stderr == "", result.stderr


def test_regional_compile_variants_compile_each_decoder_layer_and_leave_the_process_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A first build fills transformers' lazy class attributes; then nothing may change.
    config = model_zoo.build_config(TINY, model_zoo.FAMILIES["llama"])
    model_zoo.build_model(config, CPU, torch.float32, 0)
    watched = patches.Snapshot(
        patches.namespaces_for([*model_variants.WATCHED_MODULES, modeling_llama.__name__])
    )
    names = ["compile-regional", "compile-regional+torchgraft"]
    args = ["bench", "model", "--size", "tiny", "--device", "cpu", *FAST, "--no-profile"]
    args += ["--variants", ",".join(names), "--compile-backend", "aot_eager", "--no-plot"]
    status = cli.main([*args, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "checks: all passed" in out  # dynamo's own module globals are not counted as patches
    data = json.loads((tmp_path / "model_tiny_llama_cpu_fp32.json").read_text())
    layers = config.num_hidden_layers
    _stock, regional, adopted = data["variants"]
    assert [regional["name"], adopted["name"]] == names
    for v in (regional, adopted):
        assert v["error"] is None and v["state_problems"] == []
        assert v["notes"]["compiled_layers"] == layers
        assert v["notes"]["compile_backend"] == "aot_eager" and "compile_mode" not in v["notes"]
        assert v["max_abs_loss_diff_vs_stock"] < 1e-4
    assert regional["grafts_per_step"] == {} and adopted["grafts_per_step"]
    assert watched.changes() == []


def test_the_compile_mode_is_recorded_with_the_backend() -> None:
    setting = model_variants.Setting(CPU, "llama", "inductor", "reduce-overhead")
    assert model_variants._compile_notes(setting) == {
        "compile_backend": "inductor",
        "compile_mode": "reduce-overhead",
    }
