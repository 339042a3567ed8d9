"""``torchgraft bench OP``: every route of an op side by side (model: bench/model_command)."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .args import PROG, CliError, parse_device, parse_dtype, parse_list, parse_shapes

__all__ = ["cmd_bench"]


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from torchgraft.bench import harness, results, table

    op = harness.OPS.get(args.op)
    if args.op == "model":
        raise CliError("put the options after 'model': torchgraft bench model [options]")
    if op is None:
        raise CliError(f"unknown op {args.op!r}; known: {', '.join(harness.OPS)}")
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype) or op.default_dtype(device)
    if dtype not in op.TOLERANCE:
        raise CliError(f"{args.op} has no {dtype} benchmark")
    shapes = parse_shapes(args.shapes) if args.shapes else op.default_shapes(device, args.quick)
    for shape in shapes:
        why = op.check_shape(shape)
        if why is not None:
            raise CliError(f"bad --shapes entry {'x'.join(map(str, shape))!r} for {args.op}: {why}")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    modes = list(op.MODES) if args.mode == "both" else [args.mode]
    config = harness.BenchConfig(
        op=args.op,
        device=device,
        dtype=dtype,
        shapes=shapes,
        modes=modes,
        routes=parse_list(args.routes),
        quick=args.quick,
        cuda_graph=args.cuda_graph,
    )
    out_dir = Path(args.out)
    try:  # before the sweep, so a bad --out costs nothing
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(f"cannot write results to --out {args.out!r}: {error.strerror}") from None
    show_progress = args.progress or sys.stderr.isatty()
    try:
        report = harness.run(config, progress=show_progress, command=harness.command_line(argv))
    except harness.BenchError as error:
        raise CliError(str(error)) from None
    width = shutil.get_terminal_size((120, 24)).columns
    print(table.format_terminal(report, width=width), end="")
    written = results.write_results(report, out_dir, plot=not args.no_plot)
    print()
    print(f"wrote {written.json}")
    print(f"wrote {written.markdown}")
    if written.plot is not None:
        print(f"wrote {written.plot}")
    elif not args.no_plot:
        print(f"{PROG}: no plot: {written.plot_skipped}", file=sys.stderr)
    failed = [s for s in report.skips if s.shape is not None]
    if failed:
        print(
            f"{PROG}: {len(failed)} route run(s) gave a wrong result or an error (listed above)",
            file=sys.stderr,
        )
        return 1
    return 0
