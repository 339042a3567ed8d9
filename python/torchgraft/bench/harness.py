"""Runs a benchmark sweep: every route of an op, on every shape, checked, then timed.

For each shape the harness makes random inputs, computes the float64 reference, times a
device copy of the input (the bandwidth ceiling), then for each route and mode: builds the
route's function under its dispatcher state, runs it once and compares every result with the
reference (a wrong route is reported and not timed), notes which grafts ran, and times it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import torch

import torchgraft
from torchgraft import native

from . import cross_entropy, geglu, linear_cross_entropy, rms_norm, rope, swiglu, timing
from .counters import fired, graft_counters
from .progress import Progress
from .routes import Route

__all__ = [
    "NOT_SELECTED",
    "OPS",
    "BenchConfig",
    "BenchError",
    "BenchReport",
    "Measurement",
    "Skip",
    "run",
    "select_routes",
]

OPS: dict[str, ModuleType] = {
    m.OP: m for m in (rms_norm, swiglu, geglu, rope, cross_entropy, linear_cross_entropy)
}
"""Benchmarked ops by name. Each module provides OP, MODES, TOLERANCE (by dtype), BASELINE (the
route speedups are against), PEAK_MEMORY (whether each call's extra peak memory is recorded),
Problem(shape, dtype, device) with a ``label``, default_shapes(device, quick),
default_dtype(device), check_shape(shape), bytes_moved(problem, mode), make_inputs(problem)
(whose ``x`` is the tensor copied for the bandwidth ceiling), reference(inputs, mode) (float64),
run_once(fn, inputs, mode), timed_call(fn, inputs, mode) and routes(). An op may also give PASSES
(the kernels each mode takes at least): its report then has each mode's memory floor."""


NOT_SELECTED = "not selected (--routes)"


class BenchError(Exception):
    """A benchmark request that cannot be run as asked (the message says why)."""


@dataclass(frozen=True)
class BenchConfig:
    """What to run: one op, device and dtype; shapes, modes and routes (None: all that fit)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    shapes: Sequence[tuple[int, ...]]
    modes: Sequence[str]
    routes: Sequence[str] | None = None
    quick: bool = False
    cuda_graph: bool = False
    """Time replays of a CUDA graph of each call (CUDA only): the GPU's time without the
    host's launch overhead, which bounds small ops timed call by call."""


@dataclass(frozen=True)
class Measurement:
    """One timed (route, mode, shape)."""

    route: str
    mode: str
    shape: str
    bytes: int
    """Bytes an ideal kernel moves (the op's model; the same for every route)."""
    median_ms: float
    gbps: float
    """``bytes`` over the median time, in GB/s (1e9 bytes per second)."""
    samples: int | None
    rel_err: float
    """Largest ``||out - ref|| / ||ref||`` over the results, against the float64 reference."""
    grafts: dict[str, dict[str, int]] | None
    """Graft counters that grew during the checked run; None for routes without grafts."""
    extra_peak_bytes: int | None = None
    """Peak memory allocated during one call beyond what was allocated before it (CUDA, ops
    whose PEAK_MEMORY is set); None where not measured."""
    min_ms: float | None = None
    """The fastest timed call (None in reports written before it was recorded)."""
    max_ms: float | None = None
    """The slowest timed call: far above ``min_ms`` (:data:`timing.SPREAD_LIMIT`), the machine
    was busy while this was timed."""

    @property
    def spread(self) -> float | None:
        """``max_ms / min_ms``, or None where not recorded."""
        if self.min_ms is None or self.max_ms is None or self.min_ms <= 0:
            return None
        return self.max_ms / self.min_ms

    @property
    def grafted(self) -> bool | None:
        """Whether one of the route's grafts ran (None for routes without grafts)."""
        if self.grafts is None:
            return None
        return any(c.get("calls", 0) > 0 for c in self.grafts.values())


@dataclass(frozen=True)
class Skip:
    """A route, or one (route, mode, shape), that was not timed, and why."""

    route: str
    reason: str
    mode: str | None = None
    shape: str | None = None


@dataclass
class BenchReport:
    """Everything a run measured, plus what is needed to reproduce and read it."""

    op: str
    device: dict[str, Any]
    dtype: str
    modes: list[str]
    shapes: list[str]
    routes: list[dict[str, str | None]]
    """Every route of the op: name, summary, and ``skipped`` reason (None when it ran)."""
    versions: dict[str, str | None]
    timing: str
    quick: bool
    created: str
    command: str = ""
    baseline: str = "aten"
    """The route the table's speedups are against (the op's BASELINE)."""
    copies: list[Measurement] = field(default_factory=list)
    """``x.clone()`` per shape (route ``"copy"``): the device's copy bandwidth."""
    floors: list[Measurement] = field(default_factory=list)
    """Per shape and mode (route ``"floor"``), for ops with PASSES: copies that move the mode's
    ``bytes_moved``, one per pass, timed as the routes are (see :func:`floor_call`)."""
    measurements: list[Measurement] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    cuda_graph: bool = False
    """Whether each call was timed as replays of its CUDA graph (``--cuda-graph``)."""

    def timed_routes(self) -> list[str]:
        """Routes with at least one measurement, in route order."""
        timed = {m.route for m in self.measurements}
        return [r["name"] for r in self.routes if r["name"] in timed]

    def tried_routes(self) -> list[str]:
        """Routes that ran on at least one shape (timed, wrong or failed), in route order."""
        tried = {m.route for m in self.measurements}
        tried |= {s.route for s in self.skips if s.shape is not None}
        return [r["name"] for r in self.routes if r["name"] in tried]

    def lookup(self, route: str, mode: str, shape: str) -> Measurement | None:
        """The measurement of (route, mode, shape), if it was timed."""
        for m in self.measurements:
            if (m.route, m.mode, m.shape) == (route, mode, shape):
                return m
        return None

    def skip_reason(self, route: str, mode: str, shape: str) -> str | None:
        """Why (route, mode, shape) was not timed, if it was skipped."""
        for s in self.skips:
            if s.route == route and s.mode in (None, mode) and s.shape in (None, shape):
                return s.reason
        return None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see docs/cli.md for the fields)."""
        data = asdict(self)
        for key in ("copies", "floors", "measurements"):
            for entry, m in zip(data[key], getattr(self, key), strict=True):
                entry["grafted"] = m.grafted
        return data


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torchgraft_version() -> str | None:
    """torchgraft's version: its package metadata, else the native extension's own."""
    version = _package_version("torchgraft")
    if version is None and native.available():
        from torchgraft import _native

        version = getattr(_native, "__version__", None)
    return version


def versions() -> dict[str, str | None]:
    """Versions of everything that shapes the numbers (from metadata: no DSL is imported)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton") or _package_version("pytorch-triton"),
        "torchgraft": torchgraft_version(),
        "liger_kernel": _package_version("liger-kernel") or _package_version("liger_kernel"),
        "transformers": _package_version("transformers"),
        "nvidia_cutlass_dsl": _package_version("nvidia-cutlass-dsl"),
        "flash_attn_4": _package_version("flash-attn-4"),
        "quack_kernels": _package_version("quack-kernels"),
        "helion": _package_version("helion"),
        "platform": platform.platform(),
    }


def describe_device(device: torch.device) -> dict[str, Any]:
    """Name and properties of ``device`` for the record."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
    return {
        "type": device.type,
        "name": _cpu_name(),
        "threads": torch.get_num_threads(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def select_routes(
    op: ModuleType, device: torch.device, names: Sequence[str] | None, quick: bool
) -> tuple[list[Route], list[Skip]]:
    """The routes to run and those left out, with reasons.

    Routes named explicitly must exist and be able to run here (else :class:`BenchError`);
    without names, every route that can run is taken, except torch.compile under ``quick``.
    """
    all_routes = {r.name: r for r in op.routes()}
    if names is not None:
        unknown = [n for n in names if n not in all_routes]
        if unknown:
            raise BenchError(
                f"unknown route {unknown[0]!r} for {op.OP}; known: {', '.join(all_routes)}"
            )
        for name in names:
            reason = all_routes[name].unavailable(device)
            if reason is not None:
                raise BenchError(f"route {name!r} cannot run on {device}: {reason}")
    chosen: list[Route] = []
    skipped: list[Skip] = []
    for route in all_routes.values():
        if names is not None:
            if route.name in names:
                chosen.append(route)
            else:
                skipped.append(Skip(route.name, NOT_SELECTED))
            continue
        reason = route.unavailable(device)
        if reason is None and quick and route.name == "compile":
            reason = "--quick leaves torch.compile out (name it in --routes to include it)"
        if reason is None:
            chosen.append(route)
        else:
            skipped.append(Skip(route.name, reason))
    return chosen, skipped


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(config: BenchConfig, *, progress: bool = False, command: str = "") -> BenchReport:
    """Runs the sweep described by ``config`` and returns what it measured.

    Raises :class:`BenchError` for a request that cannot run (unknown op or route, a named
    route that is unavailable here). Failures of single routes are recorded as skips.
    """
    op = OPS.get(config.op)
    if op is None:
        raise BenchError(f"unknown op {config.op!r}; known: {', '.join(OPS)}")
    device = config.device
    if config.cuda_graph and device.type != "cuda":
        raise BenchError("--cuda-graph times CUDA graphs: it needs a CUDA device")
    chosen, skips = select_routes(op, device, config.routes, config.quick)
    report = BenchReport(
        op=config.op,
        device=describe_device(device),
        dtype=_dtype_name(config.dtype),
        modes=list(config.modes),
        shapes=["x".join(map(str, s)) for s in config.shapes],
        routes=[],
        versions=versions(),
        timing=timing.method_name(device, cuda_graph=config.cuda_graph),
        quick=config.quick,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        baseline=op.BASELINE,
        skips=skips,
        cuda_graph=config.cuda_graph,
    )
    tolerance = op.TOLERANCE[config.dtype]
    bar = Progress(len(config.shapes) * len(chosen) * len(config.modes), enabled=progress)
    was_enabled = torchgraft.is_enabled()
    try:
        for shape in config.shapes:
            problem = op.Problem(tuple(shape), config.dtype, device)
            _run_shape(op, problem, config, chosen, tolerance, report, bar)
    finally:
        bar.close()
        torchgraft.disable()
        if was_enabled:
            torchgraft.enable()
    skipped = {s.route: s.reason for s in report.skips if s.mode is None and s.shape is None}
    report.routes = [
        {"name": r.name, "summary": r.summary, "skipped": skipped.get(r.name)} for r in op.routes()
    ]
    return report


COPY_CHUNK_BYTES = 256 * 2**20
"""The most a floor copies in one call of ``copy_``. Captured in a CUDA graph, a copy becomes a
memcpy node, and on the H100 one over 1.07 GB took 0.888 ms against 0.716 ms uncaptured, while
the same bytes in four copies took 0.719 ms captured (torch 2.11; docs/fused_elementwise.md)."""


def floor_call(moved: int, passes: int, device: torch.device) -> Callable[[], object]:
    """A call that makes ``passes`` copies, each between buffers of its own, which together
    read and write ``moved`` bytes: the least time an implementation that passes over memory
    that many times can take (its memory floor), when timed as the routes are (on CUDA the L2
    cache is flushed before each call, so each copy reads from memory as a route's kernels do).
    Each copy goes in pieces of at most :data:`COPY_CHUNK_BYTES`."""
    # float32 elements: torch copies them as fast as any kernel of
    # bench/kernel_lab/copy_bandwidth_sweep.py (H100).
    elements = max(1, moved // (2 * passes * 4))
    chunk = max(1, COPY_CHUNK_BYTES // 4)
    pieces = []
    for _ in range(passes):
        src, dst = torch.rand(elements, device=device), torch.empty(elements, device=device)
        pieces += [(src[i : i + chunk], dst[i : i + chunk]) for i in range(0, elements, chunk)]

    def copies() -> None:
        for src, dst in pieces:
            dst.copy_(src)

    return copies


def _run_shape(
    op: ModuleType,
    problem: Any,
    config: BenchConfig,
    chosen: list[Route],
    tolerance: float,
    report: BenchReport,
    bar: Progress,
) -> None:
    device, label = problem.device, problem.label
    bar.show(f"{label}: inputs and float64 reference")
    inputs = op.make_inputs(problem)
    references = {mode: op.reference(inputs, mode) for mode in config.modes}
    copy_bytes = 2 * inputs.x.numel() * inputs.x.element_size()
    copy = timing.measure(inputs.x.clone, device, quick=config.quick)
    report.copies.append(_measurement("copy", "copy", label, copy_bytes, copy, 0.0, None))
    passes = getattr(op, "PASSES", None)
    for mode in config.modes if passes is not None else ():
        bar.show(f"{label}: {mode}: memory floor")
        moved = op.bytes_moved(problem, mode)
        call = floor_call(moved, passes[mode], device)
        if config.cuda_graph:
            call = timing.graphed(call, device)
        floor = timing.measure(call, device, quick=config.quick)
        del call
        report.floors.append(_measurement("floor", mode, label, moved, floor, 0.0, None))
    for route in chosen:
        try:
            with route.dispatch():
                _run_route(op, route, problem, inputs, references, config, tolerance, report, bar)
        except Exception as error:  # entering or leaving the route's dispatcher state failed
            _synchronize_quietly(device)
            report.skips.append(Skip(route.name, _one_line(error), shape=label))
    del inputs, references
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_route(
    op: ModuleType,
    route: Route,
    problem: Any,
    inputs: Any,
    references: dict[str, list[torch.Tensor]],
    config: BenchConfig,
    tolerance: float,
    report: BenchReport,
    bar: Progress,
) -> None:
    label = problem.label
    try:
        fn = route.build(problem)
    except Exception as error:
        report.skips.append(Skip(route.name, _one_line(error), shape=label))
        bar.advance(steps=len(config.modes))
        return
    for mode in config.modes:
        bar.show(f"{label} {route.name} {mode}")
        try:
            entry = _check_and_time(
                op, route, fn, inputs, references[mode], problem, mode, tolerance, config
            )
        except Exception as error:  # one failing route must not end the sweep: record it
            _synchronize_quietly(problem.device)
            entry = Skip(route.name, _one_line(error), mode=mode, shape=label)
        if isinstance(entry, Skip):
            report.skips.append(entry)
        else:
            report.measurements.append(entry)
        bar.advance()


def _synchronize_quietly(device: torch.device) -> None:
    try:
        _synchronize(device)
    except Exception:  # the error that brought us here is already being reported
        pass


def _check_and_time(
    op: ModuleType,
    route: Route,
    fn: Any,
    inputs: Any,
    reference: list[torch.Tensor],
    problem: Any,
    mode: str,
    tolerance: float,
    config: BenchConfig,
) -> Measurement | Skip:
    before = graft_counters() if route.graft_prefix is not None else {}
    outputs = op.run_once(fn, inputs, mode)
    _synchronize(problem.device)
    grafts = None
    if route.graft_prefix is not None:
        grafts = fired(before, graft_counters(), route.graft_prefix)
    errors = [_rel_err(out, ref) for out, ref in zip(outputs, reference, strict=True)]
    worst = max(errors)
    if not worst <= tolerance:  # also catches NaN
        return Skip(
            route.name,
            f"wrong result: relative error {worst:.2e} > {tolerance:.0e} vs float64",
            mode=mode,
            shape=problem.label,
        )
    del outputs
    call = op.timed_call(fn, inputs, mode)
    peak = timing.extra_peak_bytes(call, problem.device) if op.PEAK_MEMORY else None
    if config.cuda_graph:
        try:
            call = timing.graphed(call, problem.device)
        except Exception as error:  # capture refused (a host sync, an uncapturable call)
            return Skip(
                route.name,
                f"cannot be captured in a CUDA graph: {error}".splitlines()[0][:300],
                mode=mode,
                shape=problem.label,
            )
    result = timing.measure(call, problem.device, quick=config.quick)
    del call
    moved = op.bytes_moved(problem, mode)
    return _measurement(route.name, mode, problem.label, moved, result, worst, grafts, peak)


def _measurement(
    route: str,
    mode: str,
    shape: str,
    moved: int,
    result: timing.Timing,
    rel_err: float,
    grafts: dict[str, dict[str, int]] | None,
    extra_peak_bytes: int | None = None,
) -> Measurement:
    return Measurement(
        route=route,
        mode=mode,
        shape=shape,
        bytes=moved,
        median_ms=result.median_ms,
        gbps=moved / (result.median_ms * 1e-3) / 1e9,
        samples=result.samples,
        rel_err=rel_err,
        grafts=grafts,
        extra_peak_bytes=extra_peak_bytes,
        min_ms=result.min_ms,
        max_ms=result.max_ms,
    )


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, for the record."""
    return " ".join(["torchgraft", *argv]) if argv else " ".join(sys.argv)
