"""``torchgraft bench model``: a transformers model's training step, every variant side by side.

Exit status as for every command (see :mod:`torchgraft.cli`): 0 when every variant ran and
every check passed, 1 when a variant raised or a check failed (the files are still written),
2 for a request that cannot run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from torchgraft.cli.args import PROG, CliError, Parser, parse_device, parse_dtype

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``torchgraft bench model``."""
    from . import model_zoo
    from .model_variants import VARIANTS

    parser = Parser(
        prog=f"{PROG} bench model",
        description="A transformers model's training step (forward with labels, backward, "
        "AdamW(fused=True)) in every variant side by side: ms/step, tokens/s, peak memory, "
        "loss against stock, grafts that ran, top ops. Random weights from a config: nothing "
        "is downloaded.",
    )
    moe = [f.name for f in model_zoo.FAMILIES.values() if f.moe]
    sizes = dict.fromkeys(name for f in model_zoo.FAMILIES.values() for name in f.sizes)
    parser.add_argument(
        "--size",
        choices=list(sizes),
        help="model size (default: small on CUDA, tiny on the CPU; the MoE families: "
        f"{', '.join(model_zoo.MOE_SIZES)})",
    )
    parser.add_argument(
        "--family",
        choices=list(model_zoo.FAMILIES),
        default="llama",
        help=f"default: llama; mixtures of experts: {', '.join(moe)}",
    )
    parser.add_argument(
        "--experts-implementation",
        choices=list(model_zoo.EXPERTS_IMPLEMENTATIONS),
        help="transformers' experts forward for the MoE families (default: grouped_mm)",
    )
    parser.add_argument(
        "--variants",
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: every one that can run; "
        "stock always runs)",
    )
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", help="bf16 or fp32 (default: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--rounds", type=int, help="alternating timing rounds (default by size)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default by size)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per round (2)")
    parser.add_argument(
        "--loss-steps", type=int, default=50, help="steps whose losses are compared (50)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and batches (default 0)")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend (default inductor)"
    )
    parser.add_argument(
        "--compile-mode",
        help="torch.compile mode, e.g. max-autotune-no-cudagraphs or reduce-overhead "
        "(default: torch's default)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the per-op profile")
    parser.add_argument(
        "--out", default=os.path.join("bench", "results"), help="directory (default bench/results)"
    )
    parser.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    return parser


def _variants(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise CliError(f"empty list {text!r}")
    return names


def main(argv: Sequence[str]) -> int:
    """Runs ``torchgraft bench model ARGV``; raises :class:`CliError` for bad requests."""
    args = build_parser().parse_args(list(argv))
    import torch

    from . import model, model_output, model_zoo

    device = parse_device(args.device)
    size_name = args.size or ("small" if device.type == "cuda" else "tiny")
    dtype = parse_dtype(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in (torch.bfloat16, torch.float32):
        raise CliError(f"the model benchmark trains in bf16 or fp32, not {args.dtype}")
    try:
        defaults = model_zoo.size_for(model_zoo.FAMILIES[args.family], size_name)
    except ValueError as error:
        raise CliError(str(error)) from None
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.warmup < 0:
        raise CliError("--warmup must be at least 0")
    config = model.ModelBenchConfig(
        size=size_name,
        family=args.family,
        device=device,
        dtype=dtype,
        variants=_variants(args.variants),
        rounds=args.rounds if args.rounds is not None else defaults.rounds,
        steps=args.steps if args.steps is not None else defaults.steps,
        warmup=args.warmup,
        loss_steps=args.loss_steps,
        seed=args.seed,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        profile=not args.no_profile,
        experts_implementation=args.experts_implementation,
    )
    out_dir = Path(args.out)
    try:  # before the run, so a bad --out costs nothing
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(f"cannot write results to --out {args.out!r}: {error.strerror}") from None
    command = " ".join([PROG, "bench", "model", *argv])
    try:
        report = model.run(config, progress=args.progress or sys.stderr.isatty(), command=command)
    except model.ModelBenchError as error:
        raise CliError(str(error)) from None
    print(model_output.format_terminal(report), end="")
    written = model_output.write_model_results(report, out_dir, plot=not args.no_plot)
    print()
    for path in (written.json, written.markdown, written.plot):
        if path is not None:
            print(f"wrote {path}")
    if written.plot is None and not args.no_plot:
        print(f"{PROG}: no plot: {written.plot_skipped}", file=sys.stderr)
    problems = report.failed()
    if problems:
        for problem in problems:
            print(f"{PROG}: {problem}", file=sys.stderr)
        return 1
    return 0
