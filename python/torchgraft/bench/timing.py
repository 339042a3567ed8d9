"""Run times: one call at a time (kernels), or steps back to back in alternating rounds (loops).

:func:`measure` times one call at a time, median of many: CUDA events on a GPU with the L2
cache flushed before every timed call, so a kernel that reads a tensor smaller than L2 is timed
reading it from memory, as it would inside a model (``triton.testing.do_bench`` does exactly
this and is used when triton is installed; the event-based loop below is the same method
without triton); ``time.perf_counter`` on the CPU.

:func:`alternating_rounds` times what a training loop does: steps back to back with one
synchronisation (host work overlaps the GPU where it can), every contender once per round,
the median over rounds, so that drift of the machine hits all contenders alike.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "SPREAD_LIMIT",
    "Timing",
    "alternating_rounds",
    "back_to_back_ms",
    "extra_peak_bytes",
    "graphed",
    "measure",
    "method_name",
]

# Bytes written before each timed call on CUDA to evict the previous call's data from L2
# (H100: 50 MiB of L2; 256 MiB covers every current GPU).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


SPREAD_LIMIT = 2.0
"""The slowest timed call may take this many times the fastest before a report warns that the
machine was busy (its medians, and the speedups between them, are then unreliable)."""


@dataclass(frozen=True)
class Timing:
    """The median of several timed calls, with the fastest and the slowest."""

    median_ms: float
    samples: int | None
    """Timed calls; None where ``do_bench`` chose the count itself."""
    min_ms: float
    max_ms: float

    @property
    def spread(self) -> float:
        """The slowest call's time over the fastest's."""
        return self.max_ms / self.min_ms if self.min_ms > 0 else float("inf")


def _summary(times: list[float]) -> tuple[float, float, float]:
    return min(times), statistics.median(times), max(times)


@dataclass(frozen=True)
class _Budget:
    warmup_ms: float
    rep_ms: float
    min_samples: int
    max_samples: int


_FULL = _Budget(warmup_ms=25.0, rep_ms=100.0, min_samples=10, max_samples=1000)
_QUICK = _Budget(warmup_ms=5.0, rep_ms=20.0, min_samples=5, max_samples=100)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def method_name(device: torch.device, *, cuda_graph: bool = False) -> str:
    """How :func:`measure` times on ``device``, for the record."""
    if device.type == "cuda":
        what = "replays of a CUDA graph of each call" if cuda_graph else "each call"
        if _triton_available():
            return f"triton.testing.do_bench of {what} (CUDA events, L2 flushed per call), median"
        return f"CUDA events around {what} (L2 flushed per call), median"
    return "time.perf_counter per call, median"


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph: the returned callable replays it. Timing replays
    measures the GPU's work alone; timing ``fn`` also times the host's launches wherever they
    take longer than the GPU's work (small ops: Python, autograd and dispatch, tens of
    microseconds per launch). Raises what capture raises for code that cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(fn: Callable[[], object], device: torch.device, *, quick: bool = False) -> Timing:
    """Times ``fn()`` on ``device`` after a warm-up and returns the median over the samples,
    with the fastest and slowest (their ratio shows a busy machine: :data:`SPREAD_LIMIT`).

    ``quick`` spends about a fifth of the time (for smoke runs; medians are noisier).
    """
    budget = _QUICK if quick else _FULL
    if device.type == "cuda":
        with torch.cuda.device(device):
            if _triton_available():
                return _measure_do_bench(fn, budget)
            return _measure_cuda_events(fn, budget)
    return _measure_cpu(fn, budget)


def _sample_count(estimate_ms: float, budget: _Budget) -> int:
    wanted = int(budget.rep_ms / max(estimate_ms, 1e-6))
    return max(budget.min_samples, min(budget.max_samples, wanted))


def _measure_do_bench(fn: Callable[[], object], budget: _Budget) -> Timing:
    from triton.testing import do_bench

    low, median, high = do_bench(
        fn, warmup=budget.warmup_ms, rep=budget.rep_ms, quantiles=[0.0, 0.5, 1.0]
    )
    return Timing(median_ms=float(median), samples=None, min_ms=float(low), max_ms=float(high))


def _measure_cuda_events(fn: Callable[[], object], budget: _Budget) -> Timing:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    # Estimate one call's time (with the flush, as it will be timed) to size the loops.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    for _ in range(_sample_count(estimate, _Budget(0, budget.warmup_ms, 1, 1000))):
        fn()
    n = _sample_count(estimate, budget)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    low, median, high = _summary(times)
    return Timing(median_ms=median, samples=n, min_ms=low, max_ms=high)


def _measure_cpu(fn: Callable[[], object], budget: _Budget) -> Timing:
    # Warm up for the budget's time (at least three calls: first calls pay one-time costs),
    # then size the timed loop from the fastest recent warm-up call.
    warm: list[float] = []
    deadline = time.perf_counter() + budget.warmup_ms * 1e-3
    while len(warm) < 3 or (time.perf_counter() < deadline and len(warm) < budget.max_samples):
        t0 = time.perf_counter()
        fn()
        warm.append((time.perf_counter() - t0) * 1e3)
    estimate = min(warm[-3:])
    times = []
    for _ in range(_sample_count(estimate, budget)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    low, median, high = _summary(times)
    return Timing(median_ms=median, samples=len(times), min_ms=low, max_ms=high)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def extra_peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory allocated on ``device`` while ``fn()`` runs, beyond what was allocated
    before it (``torch.cuda.max_memory_allocated`` over the call minus ``memory_allocated``
    before; what the call returns counts until it returns). None off CUDA, where PyTorch keeps
    no such count."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
    return peak


def back_to_back_ms(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    """Milliseconds per call of ``steps`` calls of ``fn()`` back to back, synchronised once
    before and once after (host time on the CPU)."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def alternating_rounds(
    calls: Mapping[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    steps: int,
    warmup: int = 3,
    around: Callable[[str], contextlib.AbstractContextManager[object]] | None = None,
    on_error: Callable[[str, Exception], None] | None = None,
) -> dict[str, list[float]]:
    """Per-round ms per call of each contender: every round times each one, in order, as
    ``warmup`` untimed calls and then ``steps`` timed ones back to back (:func:`back_to_back_ms`).

    ``around(name)`` is the state a contender runs under, entered for its warm-up and timing
    in each round (entering it can cost one-time work, which the warm-up absorbs; leaving it
    can, e.g., move the contender's state off the device). With ``on_error``, a contender that
    raises is reported to it and left out of the later rounds (without, the error propagates).
    Take the median of each list.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    failed: set[str] = set()
    for _ in range(rounds):
        for name, call in calls.items():
            if name in failed:
                continue
            try:
                with around(name) if around is not None else contextlib.nullcontext():
                    for _ in range(warmup):
                        call()
                    times[name].append(back_to_back_ms(call, steps, device))
            except Exception as error:
                if on_error is None:
                    raise
                failed.add(name)
                on_error(name, error)
    return times
