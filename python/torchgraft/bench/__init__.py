"""Benchmarks of every route an op can take, side by side in one process.

``torchgraft bench <op>`` (see :mod:`torchgraft.cli`) drives it. Modules: :mod:`.harness` (the
sweep: check against float64, then time), :mod:`.timing` (medians with CUDA events or
perf_counter), :mod:`.routes` (routes and the dispatcher state each runs under),
:mod:`.rms_norm` (the RMSNorm routes, shapes and bytes model), the fused ops' modules
(:mod:`.swiglu`, :mod:`.geglu` over :mod:`.glu`, :mod:`.rope`, :mod:`.cross_entropy`,
:mod:`.linear_cross_entropy`, with :mod:`.fused_common`), :mod:`.table`, :mod:`.plots` and
:mod:`.results` (terminal table, Markdown, PNG and JSON), :mod:`.counters` (which grafts ran),
:mod:`.progress` (a stderr progress bar).

``torchgraft bench model`` (:mod:`.model_command`) trains a transformers model in every variant
side by side: :mod:`.model` (the run: losses, alternating rounds, profile, checks),
:mod:`.model_zoo` (sizes and families), :mod:`.model_variants` (stock, torchgraft, compile,
Liger), :mod:`.patches` (global monkey patches caught and confined), :mod:`.op_profile` (self
time by op) and :mod:`.model_output` (tables, JSON, PNG).
"""

from __future__ import annotations

from .harness import OPS, BenchConfig, BenchError, BenchReport, run

__all__ = ["OPS", "BenchConfig", "BenchError", "BenchReport", "run"]
