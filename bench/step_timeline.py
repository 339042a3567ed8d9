"""Where a training step's GPU waits: kernel time vs wall time of the yardstick's step.

    PYTHONPATH=python python3 bench/step_timeline.py --size small --out bench/results

Builds the model of ``torchgraft bench model`` (random weights), trains a few steps stock and with
torchgraft (``enable()`` + ``adopt()``), then records two steps of each under torch.profiler and
reports per step: the wall time, the time some kernel ran (the union of kernel intervals), the GPU
idle time that leaves, and the longest idle gaps with the kernels around them. A step whose idle
time is large is bound by the host (Python, launches), not by its kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import torchgraft
from torchgraft.bench.model_zoo import (
    FAMILIES,
    SIZES,
    build_config,
    build_model,
    make_batches,
    size_for,
)


def _kernels(prof: Any, device: torch.device) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and memory operation, by start (on the CPU,
    a dry run: every op)."""
    kind = (
        torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    )
    spans = []
    for e in prof.events():
        if e.device_type == kind and e.time_range.elapsed_us() > 0:
            spans.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return sorted(spans)


def _busy_and_gaps(spans: list[tuple[float, float, str]]) -> tuple[float, list[dict[str, Any]]]:
    busy, gaps = 0.0, []
    end, last = None, ""
    for start, stop, name in spans:
        if end is None or start > end:
            if end is not None:
                gaps.append({"us": start - end, "t0": end, "after": last[:80], "before": name[:80]})
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    return busy, sorted(gaps, key=lambda g: -g["us"])


def _attribute(prof: Any, gaps: list[dict[str, Any]]) -> None:
    """Adds to each gap the host ops that ran while the GPU waited (the host was behind)."""
    host = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.elapsed_us() > 10
    ]
    for g in gaps:
        t0, t1 = g["t0"], g["t0"] + g["us"]
        inside = [
            (e.time_range.start, e.name, round(e.time_range.elapsed_us()))
            for e in host
            if e.time_range.start < t1 and e.time_range.end > t0
        ]
        g["host_ops"] = [f"{name} ({us} us)" for _, name, us in sorted(inside)][:12]


def _profile(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    family = FAMILIES[args.family]
    size = size_for(family, args.size)  # the MoE families have sizes of their own
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(build_config(size, family), device, dtype, seed=0)
    if variant == "torchgraft":
        torchgraft.enable()
        torchgraft.adopt(model)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        batches = make_batches(size, 4, device, seed=1)

        def step(i: int) -> None:
            batch = batches[i % len(batches)]
            model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for i in range(3):
            step(i)
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        sync()
        walls = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(args.steps):
                start = time.perf_counter()
                step(i)
                sync()
                walls.append(1e3 * (time.perf_counter() - start))
        spans = _kernels(prof, device)
        busy, gaps = _busy_and_gaps(spans)
        _attribute(prof, gaps[:15])
        span_ms = (spans[-1][1] - spans[0][0]) / 1e3
        return {
            "wall_ms_per_step": walls,
            "kernel_span_ms": span_ms / args.steps,
            "gpu_busy_ms": busy / 1e3 / args.steps,
            "gpu_idle_ms": (span_ms - busy / 1e3) / args.steps,
            "idle_gaps_over_20us": sum(1 for g in gaps if g["us"] > 20) / args.steps,
            "idle_in_gaps_over_20us_ms": sum(g["us"] for g in gaps if g["us"] > 20)
            / 1e3
            / args.steps,
            "longest_gaps": gaps[:15],
        }
    finally:
        if variant == "torchgraft":
            torchgraft.unadopt(model)
            torchgraft.disable()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report: dict[str, Any] = {
        "size": args.size,
        "family": args.family,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
        "torch": torch.__version__,
        "variants": {v: _profile(v, args) for v in ("stock", "torchgraft")},
    }
    for name, r in report["variants"].items():
        print(
            f"{name:10s} wall {min(r['wall_ms_per_step']):7.2f} ms  kernels span "
            f"{r['kernel_span_ms']:7.2f}  busy {r['gpu_busy_ms']:7.2f}  idle "
            f"{r['gpu_idle_ms']:6.2f} ms (gaps > 20 us: {r['idle_gaps_over_20us']:.0f}, "
            f"{r['idle_in_gaps_over_20us_ms']:.2f} ms)"
        )
        for g in r["longest_gaps"][:8]:
            print(f"    {g['us']:8.1f} us  after {g['after'][:50]:50s} before {g['before'][:50]}")
            for op in g.get("host_ops", []):
                print(f"        host: {op}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"step_timeline_{args.size}_{args.family}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
