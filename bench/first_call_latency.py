"""First-call latency of F.rms_norm on CPU: stock PyTorch against torchgraft's native route.

Each sample is a fresh interpreter (so nothing is warm): it imports torch (and torchgraft,
enabled on the native route), builds the inputs, then times the first forward and the first
backward. Inputs are non-contiguous (a transposed view), the case whose output layout the native
route must work out, and contiguous. Prints medians and writes
bench/results/first_call_latency.json.

    python bench/first_call_latency.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
import torch.nn.functional as F
route = sys.argv[1]
if route == "native":
    import torchgraft
    torchgraft.enable(routes=["native"])
layout = sys.argv[2]
base = torch.randn(256, 64, requires_grad=True)
x = base.t() if layout == "transposed" else base.view(64, 256)
before = set(sys.modules)
t0 = time.perf_counter()
y = F.rms_norm(x, [256], None, 1e-6)
t1 = time.perf_counter()
y.sum().backward()
t2 = time.perf_counter()
new = sorted(m for m in set(sys.modules) - before if m.startswith(("torch._dynamo", "triton")))
print(json.dumps({"forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3, "imported": new}))
"""


def sample(route: str, layout: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, route, layout], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(runs: int) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    for layout in ("transposed", "contiguous"):
        for route in ("stock", "native"):
            # Alternate nothing here: each sample is its own process, so order does not warm.
            samples = [sample(route, layout) for _ in range(runs)]
            results[f"{route}/{layout}"] = {
                "forward_ms": statistics.median(float(s["forward_ms"]) for s in samples),
                "backward_ms": statistics.median(float(s["backward_ms"]) for s in samples),
                "imported_dynamo_or_triton": sorted({m for s in samples for m in s["imported"]}),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "first_call_latency.json"
    )
    args = parser.parse_args()
    results = measure(args.runs)
    for key, r in results.items():
        print(
            f"{key:22s} first forward {r['forward_ms']:8.3f} ms   first backward "
            f"{r['backward_ms']:8.3f} ms   dynamo/triton imported: {r['imported_dynamo_or_triton']}"
        )
    for layout in ("transposed", "contiguous"):
        stock, native = results[f"stock/{layout}"], results[f"native/{layout}"]
        ratio = float(native["forward_ms"]) / float(stock["forward_ms"])
        print(f"{layout}: native first forward / stock first forward = {ratio:.2f}x")
    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"torch": torch.__version__, "runs": args.runs, "results": results}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
