"""SwiGLU, GeGLU and RoPE on CPU: torchgraft's fused ops (Rust kernels) against the eager
composites they replace, in one process.

Forward (no grad) and forward+backward (autograd, a fixed output gradient), bf16 and f32; eager
and torchgraft run alternately, and for each the median and least wall time and the least
process CPU time (every thread's) of ``--repeats`` runs are kept. Issue 13's target:
forward+backward >= 3x faster than eager in bf16. Each row also gives the memory floor: copies
moving the bytes the pass (or passes) read and write, and eager's time over it, the most any
implementation can gain on this machine. Prints a table; writes JSON to
bench/results/fused_elementwise_cpu.json.

    python bench/fused_elementwise_cpu.py [--repeats 15] [--glu-shape 2048x4096] [--tokens 1024]

Large tensors are allocated (and page-faulted in) on every call by PyTorch's CPU allocator, in
eager and in torchgraft alike; ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages) makes that
cheaper for both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if not any(Path(p, "torchgraft").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchgraft import functional as tgf  # noqa: E402
from torchgraft.bench import timing  # noqa: E402
from torchgraft.bench.geglu import geglu_eager  # noqa: E402
from torchgraft.bench.harness import describe_device, floor_call  # noqa: E402
from torchgraft.bench.rope import llama_rope  # noqa: E402
from torchgraft.bench.swiglu import swiglu_eager  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
TARGET = 3.0  # forward+backward speedup over eager in bf16
PASSES = {"forward": 1, "forward_backward": 2}  # passes over memory an implementation makes


def measure_pair(
    eager: Callable[[], object], fused: Callable[[], object], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median and least wall milliseconds, and least process-CPU milliseconds, of each of two
    functions run alternately (so that a shared machine's load changes hit both alike)."""
    for fn in (eager, fused, eager, fused):
        fn()
    samples: dict[int, tuple[list[float], list[float]]] = {0: ([], []), 1: ([], [])}
    for _ in range(repeats):
        for i, fn in enumerate((eager, fused)):
            w, c = time.perf_counter(), time.process_time()
            fn()
            samples[i][0].append((time.perf_counter() - w) * 1e3)
            samples[i][1].append((time.process_time() - c) * 1e3)
    return tuple(  # type: ignore[return-value]
        {
            "wall_ms": statistics.median(wall),
            "best_wall_ms": min(wall),
            "cpu_ms": min(cpu),
        }
        for wall, cpu in samples.values()
    )


def floor_ms(moved: int, passes: int) -> float:
    """Median wall milliseconds of copies that move ``moved`` bytes in ``passes`` passes: what
    memory bandwidth allows an implementation (the memory floor, bench.harness.floor_call),
    timed as ``torchgraft bench`` times the CPU."""
    cpu = torch.device("cpu")
    return timing.measure(floor_call(moved, passes, cpu), cpu).median_ms


def glu_cases(shape: tuple[int, int], dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    gate = (torch.randn(shape) * 2).to(dtype).requires_grad_()
    up = torch.randn(shape).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    ops = {
        "swiglu": (swiglu_eager, tgf.swiglu),
        "geglu_tanh": (geglu_eager, lambda g, u: tgf.geglu(g, u, "tanh")),
        "geglu": (lambda g, u: F.gelu(g) * u, tgf.geglu),
    }
    cases = {}
    for name, (eager, fused) in ops.items():
        routes = {}
        for route, fn in (("eager", eager), ("torchgraft", fused)):

            def forward(fn=fn) -> object:
                with torch.no_grad():
                    return fn(gate, up)

            def forward_backward(fn=fn) -> None:
                fn(gate, up).backward(dy)
                gate.grad = None
                up.grad = None

            routes[route] = {"forward": forward, "forward_backward": forward_backward}
        # Forward: gate and up read, y written; backward: gate, up, dy read, two gradients written.
        size = gate.numel() * gate.element_size()
        routes["moved"] = {"forward": 3 * size, "forward_backward": 8 * size}
        cases[name] = routes
    return cases


def rope_cases(tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    batch, heads, kv_heads, dim = 2, 32, 8, 128
    torch.manual_seed(0)
    qp = torch.randn(batch, tokens, heads * dim).to(dtype).requires_grad_()
    kp = torch.randn(batch, tokens, kv_heads * dim).to(dtype).requires_grad_()
    angles = torch.rand(batch, tokens, dim) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def views() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            qp.view(batch, tokens, heads, dim).transpose(1, 2),
            kp.view(batch, tokens, kv_heads, dim).transpose(1, 2),
        )

    def eager(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return llama_rope(q, k, cos, sin)

    q0, k0 = views()
    grads = tuple(torch.randn_like(t) for t in eager(q0, k0))
    routes = {}
    for route, fn in (("eager", eager), ("torchgraft", lambda q, k: tgf.rope(q, k, cos, sin))):

        def forward(fn=fn) -> object:
            with torch.no_grad():
                return fn(*views())

        def forward_backward(fn=fn) -> None:
            torch.autograd.backward(fn(*views()), grads)
            qp.grad = None
            kp.grad = None

        routes[route] = {"forward": forward, "forward_backward": forward_backward}
    # Each pass reads q and k (or their gradients) and the tables, and writes q and k.
    item = qp.element_size()
    forward = (2 * (qp.numel() + kp.numel()) + 2 * cos.numel()) * item
    routes["moved"] = {"forward": forward, "forward_backward": 2 * forward}
    return {"rope": routes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--glu-shape", default="2048x4096")
    parser.add_argument("--tokens", type=int, default=1024, help="RoPE tokens per sequence (x2)")
    args = parser.parse_args()
    glu_shape = tuple(int(v) for v in args.glu_shape.split("x"))
    assert len(glu_shape) == 2, "--glu-shape is ROWSxCOLS"

    results: dict[str, Any] = {}
    load_before = os.getloadavg()
    print(
        f"{'op':11} {'dtype':5} {'pass':16} {'eager ms':>9} {'tg ms':>8} {'speedup':>8} "
        f"{'cpu-time speedup':>17} {'floor ms':>9} {'eager/floor':>12}"
    )
    for dtype_name, dtype in DTYPES.items():
        cases = {**glu_cases(glu_shape, dtype), **rope_cases(args.tokens, dtype)}
        for op, routes in cases.items():
            for mode in ("forward", "forward_backward"):
                eager, fused = measure_pair(
                    routes["eager"][mode], routes["torchgraft"][mode], args.repeats
                )
                floor = floor_ms(routes["moved"][mode], PASSES[mode])
                row = {
                    "eager": eager,
                    "torchgraft": fused,
                    "speedup_wall": eager["wall_ms"] / fused["wall_ms"],
                    "speedup_cpu": eager["cpu_ms"] / fused["cpu_ms"],
                    "bytes_moved": routes["moved"][mode],
                    "floor_ms": floor,
                    # The largest speedup over eager that memory bandwidth allows.
                    "eager_over_floor": eager["wall_ms"] / floor,
                }
                results[f"{op}/{dtype_name}/{mode}"] = row
                mark = ""
                if dtype_name == "bf16" and mode == "forward_backward":
                    mark = "  PASS" if row["speedup_wall"] >= TARGET else f"  (target {TARGET}x)"
                print(
                    f"{op:11} {dtype_name:5} {mode:16} {eager['wall_ms']:9.2f} "
                    f"{fused['wall_ms']:8.2f} {row['speedup_wall']:7.2f}x "
                    f"{row['speedup_cpu']:16.2f}x {floor:9.2f} {row['eager_over_floor']:11.2f}x"
                    f"{mark}"
                )
    report = {
        "cpu": describe_device(torch.device("cpu"))["name"] or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "glu_shape": list(glu_shape),
        "rope": {"batch": 2, "tokens": args.tokens, "heads": 32, "kv_heads": 8, "head_dim": 128},
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
        # Other processes on a 2-core machine stall every 2-thread op by a scheduler slice:
        # numbers taken with a 1-minute load average well above 0 are not comparable.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "repeats": args.repeats,
        "results": results,
    }
    out = REPO / "bench" / "results" / "fused_elementwise_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
