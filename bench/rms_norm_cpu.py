"""RMSNorm on CPU: stock PyTorch against torchgraft's native (Rust) graft, in one process.

Times F.rms_norm forward (no_grad), backward (dx + dw from a recorded graph) and forward+backward
at (8, 1024, 4096) in bfloat16 and float32, next to x.clone() (an allocation and a copy: the
least a forward can do). Prints medians and ratios; writes JSON to bench/results/.

    python bench/rms_norm_cpu.py [--shape 8x1024x4096] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import torchgraft

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
# Issue targets on the 2-core development machine: (measurement, dtype) -> minimum speedup.
TARGETS = {("forward", "bf16"): 5.0, ("backward", "bf16"): 8.0, ("forward", "f32"): 2.5}
CLONE_TARGET = 1.5  # torchgraft forward time / x.clone() time, at most


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    hidden = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return F.rms_norm(x, [hidden], w, 1e-6)

    def backward(y: torch.Tensor) -> Callable[[], object]:
        return lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)

    def forward_backward() -> object:
        return torch.autograd.grad(F.rms_norm(x, [hidden], w, 1e-6), (x, w), dy)

    results = {"clone": median_seconds(lambda: x.detach().clone(), repeats)}
    for route in ("stock", "torchgraft"):
        if route == "torchgraft":
            torchgraft.enable()
        y = F.rms_norm(x, [hidden], w, 1e-6)
        results[f"{route}.forward"] = median_seconds(forward, repeats)
        results[f"{route}.backward"] = median_seconds(backward(y), repeats)
        results[f"{route}.forward_backward"] = median_seconds(forward_backward, repeats)
        torchgraft.disable()
    return results


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x1024x4096")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench/results/rms_norm_cpu.json"))
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))

    report: dict[str, object] = {
        "benchmark": "F.rms_norm on CPU, stock vs torchgraft native route",
        "shape": list(shape),
        "device": cpu_model(),
        "cpu_count": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "unit": "seconds (median)",
        "results": {},
        "checks": [],
    }
    print(f"F.rms_norm {shape} on {report['device']}, {torch.get_num_threads()} threads")
    print(f"{'dtype':6} {'measurement':18} {'stock ms':>10} {'torchgraft ms':>14} {'speedup':>8}")
    for name, dtype in DTYPES.items():
        r = measure(shape, dtype, args.repeats)
        report["results"][name] = r
        for what in ("forward", "backward", "forward_backward"):
            stock, ours = r[f"stock.{what}"], r[f"torchgraft.{what}"]
            speedup = stock / ours
            print(f"{name:6} {what:18} {stock * 1e3:10.2f} {ours * 1e3:14.2f} {speedup:7.2f}x")
            target = TARGETS.get((what, name))
            if target is not None:
                report["checks"].append(
                    {
                        "check": f"{name} {what} speedup >= {target}x",
                        "value": speedup,
                        "pass": speedup >= target,
                    }
                )
        vs_clone = r["torchgraft.forward"] / r["clone"]
        print(
            f"{name:6} {'x.clone()':18} {r['clone'] * 1e3:10.2f}   torchgraft forward = "
            f"{vs_clone:.2f}x clone"
        )
        report["checks"].append(
            {
                "check": f"{name} forward <= {CLONE_TARGET}x clone",
                "value": vs_clone,
                "pass": vs_clone <= CLONE_TARGET,
            }
        )
    print()
    for check in report["checks"]:
        print(f"{'PASS' if check['pass'] else 'MISS'}  {check['check']}: {check['value']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
