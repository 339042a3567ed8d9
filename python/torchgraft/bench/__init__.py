"""Benchmarks of every route an op can take, side by side in one process.

``torchgraft bench <op>`` (see :mod:`torchgraft.cli`) drives it. Modules: :mod:`.harness` (the
sweep: check against float64, then time), :mod:`.timing` (medians with CUDA events or
perf_counter), :mod:`.routes` (routes and the dispatcher state each runs under),
:mod:`.rms_norm` (the RMSNorm routes, shapes and bytes model), :mod:`.table`, :mod:`.plots` and
:mod:`.results` (terminal table, Markdown, PNG and JSON), :mod:`.counters` (which grafts ran),
:mod:`.progress` (a stderr progress bar).
"""

from __future__ import annotations

from .harness import OPS, BenchConfig, BenchError, BenchReport, run

__all__ = ["OPS", "BenchConfig", "BenchError", "BenchReport", "run"]
