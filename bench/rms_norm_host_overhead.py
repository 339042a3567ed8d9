"""Host overhead per call of F.rms_norm on CUDA at a small input, route by route.

(4, 4096) bf16: the kernel takes a few microseconds, so back-to-back calls with one
synchronisation at the end measure what each route costs the host per call. Routes, in one run:
ATen's own kernel, the native route (CUDA C++ launched from Rust through the stable ABI), and
the Python route (the registry's router) both running the Triton impl and falling back to ATen.

    python bench/rms_norm_host_overhead.py [--calls 20000] [--out $OUT/host_overhead.json]
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
from torchgraft import registry
from torchgraft.grafts.rms_norm.triton_impl import fused_rms_norm_impl

SHAPE, HIDDEN = (4, 4096), 4096


def per_call_us(fn: Callable[[], object], calls: int, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def never(*args: object) -> bool:
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/rms_norm_host_overhead.json")
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    ref = F.rms_norm(x.double(), [HIDDEN], w.double(), 1e-6)

    dy = torch.randn_like(x)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [HIDDEN], w, 1e-6)
    backward = torch.ops.aten._fused_rms_norm_backward.default

    def call() -> torch.Tensor:
        return F.rms_norm(x, [HIDDEN], w, 1e-6)

    def call_backward() -> object:
        return backward(dy, x, [HIDDEN], rstd, w, [True, True])

    results: dict[str, float] = {}
    checks: dict[str, float] = {}

    def measure(route: str, expect_key: str | None) -> None:
        torchgraft.reset_stats()
        out = call()
        torch.cuda.synchronize()
        checks[route] = ((out.double() - ref).norm() / ref.norm()).item()
        if expect_key is not None:
            assert torchgraft.stats()[expect_key]["calls"] == 1, f"{route}: graft did not run"
        results[route] = per_call_us(call, args.calls)
        results[f"{route} backward"] = per_call_us(call_backward, args.calls)

    torchgraft.disable()
    measure("aten", None)
    with torchgraft.enabled(routes=["native"]):
        measure("native", "native/aten::_fused_rms_norm/CUDA")
    # ATen and native again, alternating round by round: the difference of each round's pair
    # cancels the machine's drift, which is of the order of the difference itself.
    diffs: dict[str, list[float]] = {"forward": [], "backward": []}
    for _ in range(args.rounds):
        for what, fn in (("forward", call), ("backward", call_backward)):
            torchgraft.disable()
            stock = per_call_us(fn, args.calls, repeats=1)
            with torchgraft.enabled(routes=["native"]):
                ours = per_call_us(fn, args.calls, repeats=1)
            diffs[what].append(ours - stock)
    paired = {what: statistics.median(d) for what, d in diffs.items()}
    info = registry.register_op_override(
        "triton",
        "aten",
        "_fused_rms_norm",
        "CUDA",
        None,
        fused_rms_norm_impl,
        unconditional_override=True,
    )
    measure("python-router-triton", "triton/aten::_fused_rms_norm/CUDA")
    registry.remove_override(info)
    info = registry.register_op_override(
        "bench", "aten", "_fused_rms_norm", "CUDA", never, fused_rms_norm_impl
    )
    measure("python-router-fallback", None)
    registry.remove_override(info)

    print(f"F.rms_norm {SHAPE} bf16 on {torch.cuda.get_device_name()}: host time per call")
    print(f"{'route':32} {'us/call':>9} {'vs aten':>9} {'rel err':>9}")
    for route, us in results.items():
        base = results["aten backward" if route.endswith("backward") else "aten"]
        err = checks.get(route, float("nan"))
        print(f"{route:32} {us:9.2f} {us - base:+8.2f}us {err:9.1e}")
    added = paired["forward"]
    verdict = "PASS" if added <= 1.0 else "MISS"
    print(f"native - aten, median of {args.rounds} alternating rounds: forward "
          f"{paired['forward']:+.2f} us, backward {paired['backward']:+.2f} us")  # fmt: skip
    print(f"{verdict}  native route <= ATen + 1 us per call: {added:+.2f} us")
    report = {
        "benchmark": "host time per call of F.rms_norm, (4, 4096) bf16, back-to-back, one sync",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "calls_per_sample": args.calls,
        "us_per_call_median": results,
        "rel_err_vs_float64": checks,
        "native_added_us": added,
        "native_added_us_paired_rounds": diffs,
        "pass": added <= 1.0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
