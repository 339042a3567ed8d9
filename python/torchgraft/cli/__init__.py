"""The ``torchgraft`` command (also ``python -m torchgraft``): demo, bench, doctor, list.

Every subcommand returns an exit status: 0 success, 1 a check failed (demo FAIL, a benchmark
route gave a wrong result or an error), 2 a request that cannot run (unknown op, route or
dtype, a device that is not present, a missing DSL, bad arguments), reported as one line on
stderr without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .args import PROG, CliError, Parser, parse_device, parse_dtype, parse_shapes
from .doctor import doctor_facts
from .listing import list_rows

__all__ = [
    "PROG",
    "CliError",
    "build_parser",
    "doctor_facts",
    "list_rows",
    "main",
    "parse_device",
    "parse_dtype",
    "parse_shapes",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``torchgraft`` argument parser."""
    parser = Parser(
        prog=PROG,
        description="Graft fast kernels under PyTorch's own operators: try, measure, inspect.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    sub.add_parser(
        "demo",
        help="a transformers Llama, stock vs torchgraft: adoption, accuracy, speed, ops",
        add_help=False,  # its options are its own: torchgraft.demo.main
    )

    bench = sub.add_parser("bench", help="every route of an op side by side: table, JSON, plot")
    bench.add_argument(
        "op",
        help="op to benchmark (rms_norm, swiglu, geglu, rope, cross_entropy, "
        "linear_cross_entropy), or model (see 'torchgraft bench model --help')",
    )
    bench.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    bench.add_argument(
        "--dtype", help="bf16, fp16, fp32 or fp64 (default: bf16 on CUDA, fp32 on CPU)"
    )
    bench.add_argument(
        "--shapes",
        help="e.g. 8x4096x4096,4096x1024 (rms_norm: the last dim is normalized; the other ops' "
        "shapes: docs/cli.md)",
    )
    bench.add_argument("--quick", action="store_true", help="a tiny sweep with short timings")
    bench.add_argument(
        "--mode", choices=("fwd", "fwd+bwd", "both"), default="both", help="default: both"
    )
    bench.add_argument("--routes", help="comma-separated routes (default: all that can run)")
    bench.add_argument(
        "--out", default=os.path.join("bench", "results"), help="directory (default bench/results)"
    )
    bench.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    bench.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time replays of a CUDA graph of each call: GPU time without host launch overhead",
    )
    bench.add_argument("--no-plot", action="store_true", help="write no PNG")
    bench.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")

    doctor = sub.add_parser("doctor", help="versions, GPUs, DSL runtimes, native library, switches")
    doctor.add_argument("--json", action="store_true", help="print JSON")

    listing = sub.add_parser("list", help="every native graft and registered override")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("--enable", action="store_true", help="call torchgraft.enable() first")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if args_list[:1] == ["demo"]:  # its own options: torchgraft.demo.main
            from torchgraft.demo import main as demo_main

            return demo_main(args_list[1:])
        if args_list[:2] == ["bench", "model"]:  # its own options: torchgraft/bench/model_command
            from torchgraft.bench import model_command

            return model_command.main(args_list[2:])
        args = parser.parse_args(args_list)
        if args.version:
            from torchgraft.bench.harness import torchgraft_version

            print(f"{PROG} {torchgraft_version() or 'unknown version'}")
            return 0
        if args.command is None:
            raise CliError(f"choose a command: demo, bench, doctor or list (see '{PROG} --help')")
        if args.command == "bench":
            from .bench import cmd_bench

            return cmd_bench(args, args_list)
        if args.command == "doctor":
            from .doctor import cmd_doctor

            return cmd_doctor(args)
        from .listing import cmd_list

        return cmd_list(args)
    except CliError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``torchgraft ... | head``): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
