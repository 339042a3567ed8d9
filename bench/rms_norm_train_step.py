"""RMSNorm as a training step runs it: forward + backward through autograd, back to back.

`torchgraft bench` times one call at a time with the L2 cache flushed before each, which is
right for kernels but, at small problems, counts each route's host latency in full. Here every
route runs `--steps` training steps back to back (x and weight require grad; dx and dweight
computed) with one synchronisation at the end, as a model's loop does, so host work overlaps
the GPU where it can and the step time is whichever of the two is longer.

Routes are those of `torchgraft bench rms_norm` (aten, compile, torchgraft-native,
torchgraft-triton), each checked against the float64 reference first. They are timed in
alternating rounds (every round times each route once), and the table gives each route's
median over the rounds, so that drift of the machine hits all routes alike.

    python bench/rms_norm_train_step.py [--shapes 1024x2048 ...] [--out FILE]

Writes bench/results/rms_norm_train_step.json (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from torchgraft.bench import harness
from torchgraft.bench.counters import fired, graft_counters
from torchgraft.bench.rms_norm import (
    TOLERANCE,
    Problem,
    make_inputs,
    reference,
    routes,
    run_once,
    timed_call,
)
from torchgraft.bench.timing import alternating_rounds

ROUTES = ("aten", "compile", "torchgraft-native", "torchgraft-triton")
SHAPES = ("1024x1024", "1024x2048", "4096x2048", "1024x4096", "4096x4096", "16384x4096",
          "1024x8192", "8x4096x4096")  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_shape(shape: tuple[int, ...], dtype: torch.dtype, steps: int, rounds: int) -> dict:
    problem = Problem(shape, dtype, torch.device("cuda"))
    inputs = make_inputs(problem)
    want = reference(inputs, "fwd+bwd")
    by_name = {route.name: route for route in routes()}
    calls: dict[str, Callable[[], object]] = {}
    result: dict = {"shape": problem.label, "routes": {}}
    for name in ROUTES:
        route = by_name[name]
        why = route.unavailable(problem.device)
        if why is not None:
            result["routes"][name] = {"skipped": why}
            continue
        fn = route.build(problem)
        with route.dispatch():
            before = graft_counters()
            got = run_once(fn, inputs, "fwd+bwd")
            ran = fired(before, graft_counters(), route.graft_prefix or "")
        errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
        if max(errors) > TOLERANCE[dtype]:
            sys.exit(f"{name} {problem.label}: relative error {max(errors):.1e} (y, dx, dw)")
        result["routes"][name] = {
            "rel_err": errors,
            # Counter deltas of the route's grafts; where a cond declined the forward or the
            # backward at this shape, the kernel below it ran that half.
            "grafts_fired": ran,
            "both_grafts_ran": (
                sum(delta.get("calls", 0) > 0 for delta in ran.values()) == 2
                if route.graft_prefix
                else None
            ),
        }
        calls[name] = timed_call(fn, inputs, "fwd+bwd")
    # Entering a route (re)registers its grafts; a first call can pay one-time costs there,
    # which a training loop pays once, not per step: the rounds' warm-up calls absorb them.
    round_ms = alternating_rounds(
        calls,
        problem.device,
        rounds=rounds,
        steps=steps,
        warmup=3,
        around=lambda name: by_name[name].dispatch(),
    )
    for name in calls:
        entry = result["routes"][name]
        entry["round_ms"] = round_ms[name]
        entry["median_ms"] = statistics.median(entry["round_ms"])
    base = result["routes"].get("aten", {}).get("median_ms")
    for name in calls:
        entry = result["routes"][name]
        entry["speedup_vs_aten"] = base / entry["median_ms"] if base else None
    return result


def table(results: list[dict]) -> str:
    head = "| shape | " + " | ".join(ROUTES) + " |"
    lines = [head, "|" + "---|" * (len(ROUTES) + 1)]
    for shape in results:
        cells = []
        for name in ROUTES:
            entry = shape["routes"][name]
            if "median_ms" not in entry:
                cells.append("n/a")
                continue
            mark = "\\*" if entry["both_grafts_ran"] is False else ""
            cells.append(f"{entry['median_ms']:.4f} ({entry['speedup_vs_aten']:.2f}x){mark}")
        lines.append(f"| {shape['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("bench/results/rms_norm_train_step.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("rms_norm_train_step: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    results = []
    for label in args.shapes:
        shape = tuple(int(s) for s in label.split("x"))
        results.append(run_shape(shape, dtype, args.steps, args.rounds))
        print(f"done {label}", file=sys.stderr)
    md = table(results)
    device = torch.cuda.get_device_name()
    title = f"RMSNorm training step (fwd+bwd, back to back), {args.dtype}, {device}"
    print(f"**{title}: median ms per step and speedup vs aten**\n")
    print(md)
    print("\n\\* a graft of the route declined this shape (its cond): ATen's kernel ran instead")
    print("for the forward, the backward or both (see grafts_fired in the JSON).")
    report = {
        "benchmark": "RMSNorm training step: fwd+bwd through autograd, back to back, one sync",
        "command": "python " + " ".join(sys.argv),
        "device": harness.describe_device(torch.device("cuda")),
        "versions": harness.versions(),
        "dtype": args.dtype,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "results": results,
        "table_md": md,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
