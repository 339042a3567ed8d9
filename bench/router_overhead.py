"""Host time the torchgraft router adds per call, on CPU.

For each op (aten::mm on 4x4 float32, aten::add.Tensor on 16 floats) it times the same call:

  none             no override (ATen's kernel)
  fallback         an override whose cond says no -> the previous kernel (call_boxed)
  fallback_3conds  three overrides, none matching
  matched          cond says yes, the impl returns a preallocated tensor (pure routing cost)
  matched_reenter  cond says yes, the impl calls the op again, reaching ATen's kernel (the
                   seed's `_smart_rms_norm` gate for small shapes)

REPEATS rounds; in each, every mode in turn is set up, warmed up and timed over CALLS calls. The
median per-call time is reported and "added" is its difference to "none". Results are merged into
bench/results/router_overhead.json under the torch version (run it with each torch).
``--clock cpu`` times with the thread's CPU time instead of the wall clock: on a machine shared
with other work it does not count the time the thread waits for a core (compare "min_us" then).

    PYTHONPATH=python python bench/router_overhead.py [--calls N] [--repeats R] [--out PATH]
        [--clock wall|cpu]
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

import torch

from torchgraft import registry

RESULTS = Path(__file__).resolve().parent / "results" / "router_overhead.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock = CLOCKS["wall"]


def time_per_call(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls (after a short warm-up)."""
    for _ in range(max(200, calls // 20)):
        fn()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls / 1000.0


def never(*args: object, **kwargs: object) -> bool:
    return False


def always(*args: object, **kwargs: object) -> bool:
    return True


def bench_op(
    name: str,
    op_symbol: str,
    call: Callable[[], object],
    reenter: Callable[..., object],
    out: torch.Tensor,
    calls: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    def returns_out(*args: object, **kwargs: object) -> torch.Tensor:
        return out

    setups: dict[str, Callable[[], None]] = {
        "none": lambda: None,
        "fallback": lambda: registry.register_op_override(
            "bench", "aten", op_symbol, "CPU", never, returns_out
        ),
        "fallback_3conds": lambda: [
            registry.register_op_override(f"bench{i}", "aten", op_symbol, "CPU", never, returns_out)
            for i in range(3)
        ],
        "matched": lambda: registry.register_op_override(
            "bench", "aten", op_symbol, "CPU", always, returns_out
        ),
        "matched_reenter": lambda: registry.register_op_override(
            "bench", "aten", op_symbol, "CPU", always, reenter
        ),
    }
    # Modes take turns in every round, so load from elsewhere on the machine hits all alike.
    samples: dict[str, list[float]] = {mode: [] for mode in setups}
    for _ in range(repeats):
        for mode, setup in setups.items():
            registry.clear_overrides()
            setup()
            samples[mode].append(time_per_call(call, calls))
            registry.clear_overrides()
    results = {
        mode: {"median_us": statistics.median(values), "min_us": min(values)}
        for mode, values in samples.items()
    }
    base = results["none"]["median_us"]
    for row in results.values():
        row["added_us"] = row["median_us"] - base
    print(f"\n{name}")
    print(f"  {'mode':<16} {'median us':>10} {'min us':>10} {'added us':>10}")
    for mode, row in results.items():
        cells = [f"{row[k]:>10.3f}" for k in ("median_us", "min_us", "added_us")]
        print(f"  {mode:<16} " + " ".join(cells))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]

    torch.set_num_threads(1)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    x, y = torch.randn(16), torch.randn(16)
    ops = {
        "aten::mm (4x4 f32)": bench_op(
            "aten::mm (4x4 f32)",
            "mm",
            lambda: torch.mm(a, b),
            lambda p, q: torch.ops.aten.mm.default(p, q),
            torch.mm(a, b),
            args.calls,
            args.repeats,
        ),
        "aten::add.Tensor (16 f32)": bench_op(
            "aten::add.Tensor (16 f32)",
            "add.Tensor",
            lambda: torch.add(x, y),
            lambda p, q, **kw: torch.ops.aten.add.Tensor(p, q, **kw),
            torch.add(x, y),
            args.calls,
            args.repeats,
        ),
    }
    run = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "calls_per_sample": args.calls,
        "clock": args.clock,
        "samples": args.repeats,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ops": ops,
    }
    data: dict[str, object] = {"runs": {}}
    if args.out.exists():
        data = json.loads(args.out.read_text())
    data.setdefault("runs", {})[torch.__version__] = run  # type: ignore[index]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    worst = max(op["fallback"]["added_us"] for op in ops.values())
    print(f"\nworst added per fallback call: {worst:.3f} us (target <= 10 us); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
