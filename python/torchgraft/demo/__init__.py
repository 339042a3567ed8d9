"""``torchgraft demo``: the product in a minute.

By default a small transformers Llama's training step, stock and adopted by torchgraft
(:mod:`torchgraft.demo.model`); ``--block`` runs the hand-written Llama block with
``nn.RMSNorm`` grafted (:mod:`torchgraft.demo.block`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchgraft.cli.args import PROG, CliError, Parser, parse_device, parse_dtype, parse_list

if TYPE_CHECKING:
    import torch

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``torchgraft demo``."""
    from .model import SIZES

    parser = Parser(
        prog=f"{PROG} demo",
        description="A transformers Llama's training step, stock vs torchgraft.adopt + enable: "
        "the adoption table, the difference to stock, the step time, the top ops.",
    )
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", help="bf16, fp16, fp32 or fp64 (default: bf16 on CUDA, fp32 on CPU)"
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        help="model shape (default: cpu on the CPU, 1b on CUDA): "
        + "; ".join(f"{s.name}: {s.summary}" for s in SIZES.values()),
    )
    parser.add_argument(
        "--rounds", type=int, help="timing rounds (default: the size's; --block: 5)"
    )
    parser.add_argument("--steps", type=int, help="timed steps per round (default: the size's)")
    parser.add_argument(
        "--block",
        action="store_true",
        help="the hand-written Llama block with nn.RMSNorm grafted instead of the model",
    )
    parser.add_argument(
        "--routes", help="--block only: comma-separated torchgraft routes (default: all)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Runs ``torchgraft demo ARGV``; 0 on PASS, 1 on FAIL; raises :class:`CliError` for bad
    requests."""
    args = build_parser().parse_args(list(argv))
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype)
    for option in ("rounds", "steps"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise CliError(f"--{option} must be at least 1")
    if args.block:
        if args.size is not None or args.steps is not None:
            raise CliError("--size and --steps are for the model demo, not --block")
        return _block(device, dtype, args.routes, args.rounds or 5)
    if args.routes is not None:
        raise CliError("--routes is for --block only")
    return _model(device, dtype, args.size, args.rounds, args.steps)


def _block(
    device: torch.device, dtype: torch.dtype | None, routes_text: str | None, rounds: int
) -> int:
    from torchgraft import control
    from torchgraft.bench.routes import torchgraft_route_unavailable

    from .block import run_demo

    routes = parse_list(routes_text)
    if routes is not None:
        unknown = [r for r in routes if r not in control.ROUTES]
        if unknown:
            raise CliError(f"unknown route {unknown[0]!r}; known: {', '.join(control.ROUTES)}")
        for route in routes:
            reason = torchgraft_route_unavailable(route, device)
            if reason is not None:
                raise CliError(f"route {route!r} cannot run on {device}: {reason}")
    return run_demo(device, dtype, routes, rounds=rounds)


def _model(
    device: torch.device,
    dtype: torch.dtype | None,
    size_name: str | None,
    rounds: int | None,
    steps: int | None,
) -> int:
    import torch

    from torchgraft.bench.model_zoo import transformers_missing

    from .model import SIZES, TOLERANCE, run_model_demo

    missing = transformers_missing()
    if missing is not None:
        raise CliError(f"the model demo needs transformers: {missing}; or run --block")
    on_cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if on_cuda else torch.float32)
    if dtype not in TOLERANCE:
        raise CliError(f"the model demo runs in bf16, fp16, fp32 or fp64, not {dtype}")
    size = SIZES[size_name or ("1b" if on_cuda else "cpu")]
    return run_model_demo(device, size, dtype, rounds=rounds, steps=steps)
