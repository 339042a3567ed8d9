"""Where the Triton RMSNorm route beats aten's CUDA kernel: a hidden-size x rows sweep.

Run from the repository root on the GPU machine (about 3 minutes on an H100):

    PYTHONPATH=python python3 bench/rms_norm_sweep.py [--dtypes bf16,f32,f16] [--budget 150]

For hidden sizes 1024..16384 and rows 1..32768 it times, forward and backward (dx + dw),
the Triton impls (what the graft runs after its cond) and aten's ``_fused_rms_norm`` /
``_fused_rms_norm_backward``, two ways:

- gpu: median of triton.testing.do_bench (L2 flushed before each call; host time hidden);
- host: back-to-back calls timed on the wall clock after a synchronize (includes the Python
  and launch overhead, which decides small problems).

The Triton route wins a problem when it is faster both ways. Per dtype and hidden size the
crossover is the fewest rows from which it wins at every larger row count of the sweep; the
script prints tables in the format of ``python/torchgraft/grafts/rms_norm/triton_crossover.py`` and
writes a markdown table and JSON to $OUT (or bench/results/). Dtypes are swept in the order
given until ``--budget`` seconds have passed. ``--cpu-dry-run`` checks the script on CPU under
TRITON_INTERPRET=1 with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

if "--cpu-dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from torchgraft.grafts.rms_norm import triton_cond as cond  # noqa: E402
from torchgraft.grafts.rms_norm import triton_impl as impl  # noqa: E402

HIDDEN = [1024, 2048, 3072, 4096, 5120, 8192, 12288, 16384]
ROWS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 32768]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def measure(fn: Callable[[], Any], dev: str) -> tuple[float, float]:
    """(gpu median ms from do_bench, host ms per call back to back)."""
    if dev == "cuda":
        import triton.testing

        gpu = float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
        sync = torch.cuda.synchronize
    else:
        gpu = timeit.timeit(fn, number=1) * 1e3
        sync = lambda: None  # noqa: E731
    calls = int(min(200, max(10, 20.0 / max(gpu, 1e-3))))
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return gpu, (time.perf_counter() - start) * 1e3 / calls


def measure_problem(dtype: torch.dtype, n: int, rows: int, dev: str) -> dict[str, Any]:
    """Triton route and aten, forward and backward, on one (rows, hidden) problem."""
    eps = 1e-6
    x = torch.randn(rows, n, dtype=dtype, device=dev)
    dy = torch.randn_like(x)
    w = torch.randn(n, dtype=dtype, device=dev)
    _, rstd = torch.ops.aten._fused_rms_norm(x, [n], w, eps)
    aten_bwd = torch.ops.aten._fused_rms_norm_backward
    if dev == "cpu":  # aten has no CPU backward kernel: the dry run uses the decomposition
        from torch._decomp import decomposition_table

        aten_bwd = decomposition_table[aten_bwd.default]
    fns = {
        ("fwd", "triton"): lambda: impl.fused_rms_norm_impl(x, [n], w, eps),
        ("fwd", "aten"): lambda: torch.ops.aten._fused_rms_norm(x, [n], w, eps),
        ("bwd", "triton"): lambda: impl.fused_rms_norm_backward_impl(
            dy, x, [n], rstd, w, [True, True]
        ),
        ("bwd", "aten"): lambda: aten_bwd(dy, x, [n], rstd, w, [True, True]),
    }
    times = {key: measure(fn, dev) for key, fn in fns.items()}
    record: dict[str, Any] = {"hidden": n, "rows": rows}
    for phase in ("fwd", "bwd"):
        tg, th = times[(phase, "triton")]
        ag, ah = times[(phase, "aten")]
        record[phase] = {
            "triton_gpu_ms": tg,
            "triton_host_ms": th,
            "aten_gpu_ms": ag,
            "aten_host_ms": ah,
            "speedup_gpu": ag / tg,
            "speedup_host": ah / th,
            "wins": tg < ag and th < ah,
        }
    return record


def sweep_dtype(
    dtype: torch.dtype, hidden: list[int], rows_list: list[int], dev: str
) -> list[dict]:
    records = []
    for n in hidden:
        records += [measure_problem(dtype, n, rows, dev) for rows in rows_list]
        log(f"  {dtype} hidden {n} done")
    return records


def crossover(records: list[dict], phase: str, hidden: list[int], rows_list: list[int]) -> list:
    """(hidden, min_rows) pairs: fewest rows from which Triton wins at every larger count."""
    table = []
    for n in hidden:
        wins = {r["rows"]: r[phase]["wins"] for r in records if r["hidden"] == n}
        min_rows = None  # the Triton route never wins
        for rows in reversed(rows_list):
            if not wins.get(rows, False):
                break
            min_rows = rows
        table.append((n, min_rows))
    return table


def stricter(values: Any) -> int | None:
    """The larger min_rows of several dtypes; None (never) wins."""
    values = list(values)
    return None if None in values else max(values)


def markdown(results: dict[str, list[dict]], env: dict[str, Any], rows_list: list[int]) -> str:
    lines = [
        "# RMSNorm: Triton route vs aten, speedup (aten time / Triton time)",
        "",
        f"Device: {env['device']}; torch {env['torch']}; triton {env['triton']}. "
        "Cells: do_bench median speedup; `(host x)` when the back-to-back host-timed speedup "
        "disagrees about who wins; **bold** where Triton wins both ways.",
        "",
    ]
    for name, records in results.items():
        for phase in ("fwd", "bwd"):
            lines += [f"## {name} {phase}", ""]
            lines.append("| hidden \\ rows | " + " | ".join(str(r) for r in rows_list) + " |")
            lines.append("|---" * (len(rows_list) + 1) + "|")
            for n in sorted({r["hidden"] for r in records}):
                cells = []
                for rows in rows_list:
                    rec = next((r for r in records if r["hidden"] == n and r["rows"] == rows), None)
                    if rec is None:
                        cells.append("")
                        continue
                    p = rec[phase]
                    cell = f"{p['speedup_gpu']:.2f}"
                    if (p["speedup_gpu"] > 1) != (p["speedup_host"] > 1):
                        cell += f" (host {p['speedup_host']:.2f})"
                    cells.append(f"**{cell}**" if p["wins"] else cell)
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,f32,f16")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; no new dtype after")
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu-dry-run)")
    dev = "cpu" if dry else "cuda"
    hidden, rows_list = ([32, 64], [1, 4, 16]) if dry else (HIDDEN, ROWS)
    import triton

    env = {
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    log(f"environment: {env}")
    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device=dev)
    cond_us = timeit.timeit(lambda: cond.fused_rms_norm_cond(x, [4096], None, None), number=2000)
    env["cond_us_per_call"] = cond_us / 2000 * 1e6
    log(f"cond: {env['cond_us_per_call']:.2f} us per call")
    torch.manual_seed(0)
    results: dict[str, list[dict]] = {}
    for name in args.dtypes.split(","):
        if time.time() - T0 > args.budget:
            log(f"budget spent: {name} not swept")
            break
        log(f"sweeping {name}")
        results[name] = sweep_dtype(DTYPES[name], hidden, rows_list, dev)

    suggestion: dict[str, dict[str, list]] = {"FORWARD_MIN_ROWS": {}, "BACKWARD_MIN_ROWS": {}}
    for table_name, phase in (("FORWARD_MIN_ROWS", "fwd"), ("BACKWARD_MIN_ROWS", "bwd")):
        per_dtype = {k: crossover(v, phase, hidden, rows_list) for k, v in results.items()}
        groups = {"16bit": [k for k in per_dtype if k in ("bf16", "f16")], "float32": ["f32"]}
        for group, names in groups.items():
            names = [k for k in names if k in per_dtype]
            if names:  # both 16-bit dtypes measured: the stricter of the two
                suggestion[table_name][group] = [
                    (n, stricter(per_dtype[k][i][1] for k in names)) for i, n in enumerate(hidden)
                ]
    out = {"environment": env, "hidden": hidden, "rows": rows_list, "results": results,
           "suggested_crossover": suggestion, "elapsed_s": time.time() - T0}  # fmt: skip
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "rms_norm_sweep_dry_run" if dry else "rms_norm_sweep"
    (out_dir / f"{stem}.json").write_text(json.dumps(out, indent=1))
    table = markdown(results, env, rows_list)
    (out_dir / f"{stem}.md").write_text(table + "\n")
    print(table)
    print("Suggested crossover (paste into python/torchgraft/grafts/rms_norm/triton_crossover.py):")
    for table_name, groups in suggestion.items():
        print(f"{table_name} = {{")
        for group, pairs in groups.items():
            print(f"    {group!r}: {tuple(tuple(p) for p in pairs)},")
        print("}")
    log(f"wrote {out_dir / stem}.json and .md")


if __name__ == "__main__":
    main()
