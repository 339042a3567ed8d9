"""Softmax and log-softmax on CPU: ATen's kernels against torchgraft's Rust kernels.

    PYTHONPATH=python .venv/bin/python bench/softmax_cpu.py [--numel 4194304] [--reps 9]

For each dtype, function, direction and shape (the last dim at widths 64..262144, and a middle
dim), the median of alternating rounds of ``--reps`` calls each. Writes
bench/results/softmax_cpu.json (``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import torchgraft

A = torch.ops.aten
WIDTHS = [64, 1024, 4096, 32768, 262144]


def time_ms(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def bench(numel: int, reps: int, rounds: int) -> list[dict]:
    out = []
    cases = [((numel // w, w), 1) for w in WIDTHS] + [((64, 256, numel // (64 * 256)), 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for log in (False, True):
            fwd = A._log_softmax if log else A._softmax
            bwd = A._log_softmax_backward_data if log else A._softmax_backward_data
            for shape, dim in cases:
                x = torch.randn(shape, dtype=dtype) * 3
                dy = torch.randn(shape, dtype=dtype)
                y = fwd(x, dim, False)
                fns = {
                    "forward": lambda f=fwd, x=x, d=dim: f(x, d, False),
                    "backward": lambda b=bwd, g=dy, y=y, d=dim, t=dtype: b(g, y, d, t),
                }
                row = {"dtype": str(dtype), "op": "log_softmax" if log else "softmax"}
                row |= {"shape": list(shape), "dim": dim}
                for name, fn in fns.items():
                    samples: dict[str, list[float]] = {"aten": [], "torchgraft": []}
                    for _ in range(rounds):
                        torchgraft.disable()
                        samples["aten"].append(time_ms(fn, reps))
                        torchgraft.enable()
                        samples["torchgraft"].append(time_ms(fn, reps))
                        torchgraft.disable()
                    ms = {k: statistics.median(v) for k, v in samples.items()}
                    row[f"{name}_ms"] = ms
                    row[f"{name}_speedup"] = ms["aten"] / ms["torchgraft"]
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numel": args.numel,
        "runs": bench(args.numel, args.reps, args.rounds),
    }
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "softmax_cpu.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
