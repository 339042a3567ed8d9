"""The end-to-end yardstick: a transformers model's training step, every variant side by side.

A step is what a training loop does: forward with labels (the model computes the loss),
backward, ``torch.optim.AdamW(fused=True)`` step (plain AdamW where this torch has no fused
kernel for the device), gradients set to None. The run, in one process:

1. **Losses** (each variant in turn): a fresh model from the seed (the same weights for every
   variant), the variant applied, ``loss_steps`` steps over the same batches; the losses are
   compared with stock's step by step, and the graft counters that moved are noted. Peak
   memory (CUDA) is ``torch.cuda.max_memory_allocated`` over these steps, with only this
   variant on the device.
2. **Timing** in alternating rounds: each round runs every variant in turn, ``warmup`` untimed
   steps and then ``steps`` steps back to back with one synchronisation; ms/step is the median
   over rounds, so that drift of the machine hits every variant alike.
3. **Profile**: one more step counted (graft calls per step) and one profiled (self time by op).

On CUDA a variant's model and optimizer state move to host memory while the other variants run
their loss steps, so each peak is its own; in the timing rounds idle variants stay on the device
when all of them fit (their state plus the largest step's working memory in 90% of it), else
they move off and back around every turn (outside the timed steps).

Every variant's process-wide state (torchgraft on or off, Liger's global patches) is entered
around its own steps only; after each phase the watched module namespaces, torchgraft's state
and the graft counters of stock variants are checked (``checks`` in the report).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import torchgraft
from torchgraft import native

from . import model_zoo, patches, timing
from .counters import dynamo_graphs, fired, graft_counters, graph_breaks
from .harness import describe_device, versions
from .model_variants import VARIANTS, Prepared, Setting, Variant, watched_namespaces
from .op_profile import profile_step
from .progress import Progress

__all__ = ["ModelBenchConfig", "ModelBenchError", "ModelReport", "VariantResult", "run"]

REFERENCE = "stock"


class ModelBenchError(Exception):
    """A model benchmark that cannot run as asked (the message says why)."""


@dataclass(frozen=True)
class ModelBenchConfig:
    """What to run."""

    size: str
    family: str
    device: torch.device
    dtype: torch.dtype
    variants: Sequence[str] | None = None
    """Names (``stock`` is always added: it is the reference); None: every one that can run."""
    rounds: int = 5
    steps: int = 10
    warmup: int = 2
    loss_steps: int = 50
    seed: int = 0
    lr: float = 3e-4
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    profile: bool = True
    experts_implementation: str | None = None
    """MoE families: transformers' experts forward (:data:`model_zoo.EXPERTS_IMPLEMENTATIONS`;
    None: ``grouped_mm``, transformers' default); dense families: None."""


@dataclass
class VariantResult:
    """Everything measured for one variant."""

    name: str
    summary: str
    notes: dict[str, Any] = field(default_factory=dict)
    ms_per_step: float | None = None
    round_ms: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilization: the step's FLOPs per second over the GPU's dense bf16 peak."""
    speedup_vs_stock: float | None = None
    peak_gib: float | None = None
    resident_gib: float | None = None
    """Device memory the variant holds between steps (model and optimizer state; CUDA)."""
    losses: list[float] = field(default_factory=list)
    max_abs_loss_diff_vs_stock: float | None = None
    grafts_during_losses: dict[str, dict[str, int]] = field(default_factory=dict)
    """Graft counter deltas over the loss steps."""
    grafts_per_step: dict[str, dict[str, int]] | None = None
    """Graft counter deltas over one steady-state step."""
    graph_breaks: int | None = None
    """Graph breaks dynamo took during the loss steps (compiling included)."""
    graphs_compiled_while_timed: int | None = None
    """Graphs dynamo compiled during the timed rounds (should be 0: a recompile means the
    compiled variant was timed partly while compiling, or fell back to eager)."""
    profile: dict[str, Any] | None = None
    state_problems: list[str] = field(default_factory=list)
    """What was not as it should be after this variant ran (empty: all restored)."""
    error: str | None = None


@dataclass
class ModelReport:
    """A model benchmark's results, with what is needed to reproduce and read them."""

    size: dict[str, Any]
    family: str
    experts_implementation: str | None
    """transformers' experts forward (MoE families; None: a dense model)."""
    device: dict[str, Any]
    dtype: str
    optimizer: str
    seed: int
    lr: float
    rounds: int
    steps: int
    warmup: int
    loss_steps: int
    tokens_per_step: int
    parameters: int
    active_parameters: int
    """The parameters one token's forward multiplies with (MoE: the router's picks only)."""
    flops_per_step: float
    """Training FLOPs of one step (:func:`model_zoo.flops_per_step`)."""
    peak_tflops: float | None
    """The GPU's dense bf16 peak used for MFU (None: no MFU)."""
    timing: str
    versions: dict[str, str | None]
    created: str
    command: str
    variants: list[VariantResult] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    idle_variants: str = ""
    """Where variants waited while another one ran (CUDA: on the device when all fit, else
    in host memory; peak memory is always measured with the variant alone on the device)."""
    benchmark: str = "model"

    def result(self, name: str) -> VariantResult | None:
        """The result of variant ``name``, if it ran."""
        return next((v for v in self.variants if v.name == name), None)

    def failed(self) -> list[str]:
        """Why the run is not a clean pass: variant errors and failed checks."""
        problems = [f"{v.name}: {v.error}" for v in self.variants if v.error]
        problems += [f"{v.name}: {problem}" for v in self.variants for problem in v.state_problems]
        problems += [f"check {name} failed" for name, ok in self.checks.items() if ok is False]
        return problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see docs/cli.md for the fields)."""
        return asdict(self)


# ---- one variant's model, optimizer and steps ---------------------------------------------------


def _model_signature(model: torch.nn.Module) -> list[tuple[str, type, Any]]:
    """Each module's name, class and instance-level ``forward`` (what adoption swaps)."""
    return [(name, type(m), vars(m).get("forward")) for name, m in model.named_modules()]


@dataclass
class _Live:
    variant: Variant
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    prepared: Prepared
    result: VariantResult
    built: list[tuple[str, type, Any]]
    """The model's :func:`_model_signature` before the variant was applied."""

    def move(self, device: torch.device) -> None:
        """Moves parameters (in place: the optimizer keeps them) and optimizer state."""
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device:
                    state[key] = value.to(device)


def _optimizer(model: torch.nn.Module, lr: float) -> tuple[torch.optim.Optimizer, str]:
    params = list(model.parameters())
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), f"AdamW(lr={lr}, fused=True)"
    except (RuntimeError, ValueError):  # no fused kernel for this device in this torch
        return torch.optim.AdamW(params, lr=lr), f"AdamW(lr={lr}) (fused not available here)"


class _Steps:
    """A variant's training step over the run's batches, in turn."""

    def __init__(self, live: _Live, batches: list[torch.Tensor]) -> None:
        self.live = live
        self.batches = batches
        self.count = 0

    def __call__(self) -> torch.Tensor:
        batch = self.batches[self.count % len(self.batches)]
        self.count += 1
        optimizer = self.live.optimizer
        loss = self.live.prepared.call(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().clone()  # a CUDA graph (reduce-overhead) reuses its output buffers


# ---- process state that must not leak -----------------------------------------------------------


def _dispatcher_state() -> tuple[Any, ...]:
    """torchgraft's process-wide state: enabled, active native grafts, registry overrides."""
    grafts = tuple((g.op, g.dispatch_key, g.active) for g in native.grafts())
    overrides = tuple(
        (o.dsl, o.op, o.dispatch_key, o.active)
        for o in importlib.import_module("torchgraft.registry").list_overrides()
    )
    return (torchgraft.is_enabled(), grafts, overrides)


class _Baseline:
    """The process state at the start, to check every variant leaves it as it found it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.namespaces = patches.Snapshot(watched_namespaces(model))
        # The first enable() of a process leaves one graft for good (the CPU RMSNorm backward,
        # which stock lacks; docs/reliability.md): switch once so the baseline already has it.
        if not torchgraft.is_enabled():
            with torchgraft.enabled():
                pass
        self.dispatcher = _dispatcher_state()

    def problems(self) -> list[str]:
        found = [f"{patches.where(p)} changed" for p in self.namespaces.changes()]
        if _dispatcher_state() != self.dispatcher:
            found.append("torchgraft's grafts or overrides were left changed")
        return found


def _peak_tflops(config: ModelBenchConfig) -> float | None:
    """The dense bf16 peak MFU is measured against: CUDA, bf16, a GPU with a known peak."""
    if config.device.type != "cuda" or config.dtype != torch.bfloat16:
        return None
    return model_zoo.peak_bf16_tflops(torch.cuda.get_device_name(config.device))


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


# ---- the run ------------------------------------------------------------------------------------


class _Run:
    def __init__(self, config: ModelBenchConfig, chosen: list[Variant], bar: Progress) -> None:
        self.config = config
        self.chosen = chosen
        self.bar = bar
        self.device = config.device
        self.on_cuda = config.device.type == "cuda"
        family = model_zoo.FAMILIES[config.family]
        self.size = model_zoo.size_for(family, config.size)
        self.model_config = model_zoo.build_config(
            self.size, family, _experts_implementation(config)
        )
        self.setting = Setting(
            config.device, config.family, config.compile_backend, config.compile_mode
        )
        self.batches = model_zoo.make_batches(
            self.size, min(config.loss_steps, 4), config.device, config.seed + 1
        )
        self.live: dict[str, _Live] = {}
        self.results: list[VariantResult] = []
        self.optimizer_name = ""
        self.parameters = 0
        self.baseline: _Baseline | None = None
        self.keep_resident = False
        """Idle variants stay on the device (CUDA, once the loss steps showed they all fit)."""

    # -- helpers --

    def _park(self, live: _Live) -> None:
        if self.on_cuda and not self.keep_resident:
            live.move(torch.device("cpu"))
            torch.cuda.empty_cache()

    def _everyone_fits(self) -> bool:
        """Whether every variant's model and optimizer state, plus the largest step's
        working memory, fit in 90% of the device, so idle variants can stay on it."""
        if not self.on_cuda or not self.live:
            return False
        results = [live.result for live in self.live.values()]
        if any(r.resident_gib is None or r.peak_gib is None for r in results):
            return False
        resident = sum(r.resident_gib or 0.0 for r in results)
        working = max((r.peak_gib or 0.0) - (r.resident_gib or 0.0) for r in results)
        total = torch.cuda.get_device_properties(self.device).total_memory / 2**30
        return resident + working <= 0.9 * total

    def _unpark(self, live: _Live) -> None:
        if self.on_cuda:
            live.move(self.device)

    @contextlib.contextmanager
    def _turn(self, live: _Live) -> Iterator[None]:
        """The variant on the device and in its process state; checked and parked after."""
        with self._checked(live.result):
            self._unpark(live)
            try:
                with live.prepared.active():
                    yield
            finally:
                self._park(live)

    @contextlib.contextmanager
    def _checked(self, result: VariantResult) -> Iterator[None]:
        """Notes on ``result`` what the block left changed in the process that was not changed
        before it (so a leak is charged to the variant that made it, once)."""
        assert self.baseline is not None
        before = set(self.baseline.problems())
        try:
            yield
        finally:
            for problem in self.baseline.problems():
                if problem not in before and problem not in result.state_problems:
                    result.state_problems.append(problem)

    def _fail(self, live: _Live, error: BaseException) -> None:
        live.result.error = _one_line(error)
        self._drop(live)

    def _drop(self, live: _Live) -> None:
        self.live.pop(live.variant.name, None)
        try:
            live.prepared.undo()
        except Exception as error:
            live.result.state_problems.append(f"undo failed: {_one_line(error)}")
        else:
            restored = _model_signature(live.model) == live.built
            if live.prepared.undo_restores_model and not restored:
                live.result.state_problems.append("the model's modules were not restored")
        live.optimizer.state.clear()
        del live.model, live.optimizer, live.prepared
        self._release_memory()

    def _release_memory(self) -> None:
        """Frees the device memory of dropped variants (CUDA; the CPU has no cache to free)."""
        if self.on_cuda:
            gc.collect()
            torch.cuda.empty_cache()

    # -- phase 1: build, apply, loss steps --

    def losses(self) -> None:
        for variant in self.chosen:
            result = VariantResult(variant.name, variant.summary)
            self.results.append(result)
            self.bar.show(f"{variant.name}: build and {self.config.loss_steps} loss steps")
            try:
                self._losses(variant, result)
            except Exception as error:
                result.error = _one_line(error)
                live = self.live.get(variant.name)
                if live is not None:
                    self._drop(live)
                self._release_memory()
            self.bar.advance(variant.name)

    def _losses(self, variant: Variant, result: VariantResult) -> None:
        config = self.config
        model = model_zoo.build_model(self.model_config, self.device, config.dtype, config.seed)
        if self.baseline is None:  # the family's modules are imported now
            self.baseline = _Baseline(model)
            self.parameters = sum(p.numel() for p in model.parameters())
        optimizer, self.optimizer_name = _optimizer(model, config.lr)
        built = _model_signature(model)
        with self._checked(result):  # applying it must not change the process
            prepared = variant.prepare(model, self.setting)
        result.notes = dict(prepared.notes)
        live = _Live(variant, model, optimizer, prepared, result, built)
        self.live[variant.name] = live
        step = _Steps(live, self.batches)
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        graphs, breaks = dynamo_graphs(), graph_breaks()
        with self._turn(live):
            before = graft_counters()
            losses = torch.stack([step() for _ in range(config.loss_steps)])
            result.losses = losses.float().tolist()
            result.grafts_during_losses = fired(before, graft_counters())
            if self.on_cuda:
                result.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
                # No gradients or activations are left: the model and the optimizer's state.
                result.resident_gib = torch.cuda.memory_allocated(self.device) / 2**30
        if graphs != dynamo_graphs():
            result.notes["graphs_compiled_in_loss_steps"] = dynamo_graphs() - graphs
        result.graph_breaks = graph_breaks() - breaks

    # -- phase 2: alternating rounds --

    def time(self) -> None:
        self.keep_resident = self._everyone_fits()
        if self.keep_resident:  # once, instead of a round trip per turn
            for live in self.live.values():
                self._unpark(live)
        steps = {name: _Steps(live, self.batches) for name, live in self.live.items()}
        graphs = {name: 0 for name in steps}

        @contextlib.contextmanager
        def around(name: str) -> Iterator[None]:
            live = self.live[name]
            self.bar.show(f"timing {name}")
            start = dynamo_graphs()
            try:
                with self._turn(live):
                    yield
            finally:
                graphs[name] += dynamo_graphs() - start
                self.bar.advance(f"timed {name}")

        def on_error(name: str, error: Exception) -> None:
            self._fail(self.live[name], error)

        round_ms = timing.alternating_rounds(
            steps,
            self.device,
            rounds=self.config.rounds,
            steps=self.config.steps,
            warmup=self.config.warmup,
            around=around,
            on_error=on_error,
        )
        for name, times in round_ms.items():
            result = next(r for r in self.results if r.name == name)
            if result.error is None and times:
                result.round_ms = times
                result.ms_per_step = statistics.median(times)
                result.tokens_per_s = self.size.tokens / (result.ms_per_step / 1e3)
                result.graphs_compiled_while_timed = graphs[name]

    # -- phase 3: graft calls per step, and the profile --

    def profile(self) -> None:
        for name, live in list(self.live.items()):
            self.bar.show(f"profile {name}")
            step = _Steps(live, self.batches)
            try:
                with self._turn(live):
                    step()
                    before = graft_counters()
                    step()
                    _synchronize(self.device)
                    live.result.grafts_per_step = fired(before, graft_counters())
                    if self.config.profile:
                        live.result.profile = profile_step(step, self.device).to_json()
            except Exception as error:
                self._fail(live, error)
            self.bar.advance(f"profiled {name}")

    def teardown(self) -> None:
        compiled = any("compile_backend" in r.notes for r in self.results)
        for live in list(self.live.values()):
            with self._checked(live.result):
                self._drop(live)
        if compiled:  # compiled code holds the models' graphs: let them go
            import torch._dynamo

            torch._dynamo.reset()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def select_variants(
    names: Sequence[str] | None, setting: Setting
) -> tuple[list[Variant], list[dict[str, str]]]:
    """The variants to run and those left out, with reasons. ``stock`` always runs first.

    A variant named explicitly must exist and be able to run here (else
    :class:`ModelBenchError`); without names, every variant that can run is taken.
    """
    if names is not None:
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise ModelBenchError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
        for name in names:
            reason = VARIANTS[name].unavailable(setting)
            if reason is not None:
                raise ModelBenchError(f"variant {name!r} cannot run on {setting.device}: {reason}")
    chosen, skipped = [], []
    for variant in VARIANTS.values():
        if names is not None and variant.name not in names and variant.name != REFERENCE:
            skipped.append({"name": variant.name, "reason": "not selected (--variants)"})
            continue
        reason = variant.unavailable(setting)
        if reason is None:
            chosen.append(variant)
        else:
            skipped.append({"name": variant.name, "reason": reason})
    return chosen, skipped


def _compare(results: list[VariantResult]) -> dict[str, Any]:
    """Speedups and loss differences against stock, and the run's honesty checks."""
    stock = next((r for r in results if r.name == REFERENCE and r.error is None), None)
    for r in results:
        if stock is None or r.error is not None:
            continue
        if stock.ms_per_step and r.ms_per_step:
            r.speedup_vs_stock = stock.ms_per_step / r.ms_per_step
        if stock.losses and len(r.losses) == len(stock.losses):
            r.max_abs_loss_diff_vs_stock = max(
                abs(a - b) for a, b in zip(r.losses, stock.losses, strict=True)
            )
    variants = {v.name: v for v in VARIANTS.values()}
    ran = [r for r in results if r.error is None]
    checks: dict[str, Any] = {
        # Graft counters must not move in variants that run with torchgraft off.
        "no_grafts_with_torchgraft_off": all(
            not r.grafts_during_losses and not r.grafts_per_step
            for r in ran
            if not variants[r.name].grafts
        ),
        "state_restored_after_every_variant": all(not r.state_problems for r in results),
        "losses_finite": all(all(x == x and abs(x) != float("inf") for x in r.losses) for r in ran),
        "no_recompiles_while_timed": all(not r.graphs_compiled_while_timed for r in ran),
        # fullgraph=True must hold on an adopted model: no torchgraft op or layer breaks a graph.
        "no_graph_breaks_in_compiled_torchgraft": all(
            not r.graph_breaks for r in ran if variants[r.name].grafts and "compile" in r.name
        ),
    }
    again = next((r for r in ran if r.name == "stock-again"), None)
    checks["stock_again_max_abs_loss_diff"] = (
        again.max_abs_loss_diff_vs_stock if again is not None else None
    )
    return checks


def _experts_implementation(config: ModelBenchConfig) -> str | None:
    """The experts forward the run's models use: MoE families only, transformers' default
    unless asked."""
    if not model_zoo.FAMILIES[config.family].moe:
        return None
    return config.experts_implementation or model_zoo.EXPERTS_IMPLEMENTATIONS[0]


def run(config: ModelBenchConfig, *, progress: bool = False, command: str = "") -> ModelReport:
    """Runs the model benchmark (see the module docstring) and returns its report.

    torchgraft's enabled state is the same afterwards as before.
    """
    if config.family not in model_zoo.FAMILIES:
        raise ModelBenchError(
            f"unknown family {config.family!r}; known: {', '.join(model_zoo.FAMILIES)}"
        )
    try:
        size = model_zoo.size_for(model_zoo.FAMILIES[config.family], config.size)
    except ValueError as error:
        raise ModelBenchError(str(error)) from None
    if config.experts_implementation is not None:
        if size.experts is None:
            moe = [f.name for f in model_zoo.FAMILIES.values() if f.moe]
            raise ModelBenchError(
                f"--experts-implementation is for the MoE families ({', '.join(moe)})"
            )
        if config.experts_implementation not in model_zoo.EXPERTS_IMPLEMENTATIONS:
            raise ModelBenchError(
                f"unknown experts implementation {config.experts_implementation!r}; known: "
                + ", ".join(model_zoo.EXPERTS_IMPLEMENTATIONS)
            )
    missing = model_zoo.transformers_missing()
    if missing is not None:
        raise ModelBenchError(missing)
    for option, value in (
        ("--rounds", config.rounds),
        ("--steps", config.steps),
        ("--loss-steps", config.loss_steps),
    ):
        if value < 1:
            raise ModelBenchError(f"{option} must be at least 1")
    setting = Setting(config.device, config.family, config.compile_backend, config.compile_mode)
    chosen, skipped = select_variants(config.variants, setting)
    total = len(chosen) * (config.rounds + 2)
    bar = Progress(total, enabled=progress)
    was_enabled = torchgraft.is_enabled()
    torchgraft.disable()
    state = _Run(config, chosen, bar)
    try:
        state.losses()
        state.time()
        state.profile()
    finally:
        state.teardown()
        bar.close()
        torchgraft.disable()
        if was_enabled:
            torchgraft.enable()
    report = ModelReport(
        size=size.to_json(),
        family=config.family,
        experts_implementation=_experts_implementation(config),
        device=describe_device(config.device),
        dtype=str(config.dtype).removeprefix("torch."),
        optimizer=state.optimizer_name,
        seed=config.seed,
        lr=config.lr,
        rounds=config.rounds,
        steps=config.steps,
        warmup=config.warmup,
        loss_steps=config.loss_steps,
        tokens_per_step=size.tokens,
        parameters=state.parameters,
        active_parameters=model_zoo.active_parameters(size, state.parameters),
        flops_per_step=model_zoo.flops_per_step(size, state.parameters),
        peak_tflops=_peak_tflops(config),
        timing=(
            f"median over {config.rounds} alternating rounds of {config.steps} steps back to "
            f"back ({config.warmup} untimed steps first), "
            + ("synchronised once per round" if config.device.type == "cuda" else "host time")
        ),
        versions=versions(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        variants=state.results,
        skipped=skipped,
    )
    report.checks = _compare(state.results)
    for r in state.results:
        if report.peak_tflops is not None and r.ms_per_step:
            achieved = report.flops_per_step / (r.ms_per_step / 1e3)
            r.mfu = achieved / (report.peak_tflops * 1e12)
    if config.device.type != "cuda":
        report.idle_variants = "in memory (CPU)"
    elif state.keep_resident:
        report.idle_variants = "on the device (all fit) while timed; in host memory before"
    else:
        report.idle_variants = "in host memory (moved off the device between turns)"
    return report
