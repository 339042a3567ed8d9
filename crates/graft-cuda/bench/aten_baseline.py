"""Baselines for graft-cuda's self-test timings: ATen's fused RMSNorm and torch.compile.

Times, at the self-test's shapes and with its method (CUDA events around each call,
warm-up, median of many reps, three rotating buffer sets), on bf16 with a bf16 weight:
  copy      a device-to-device copy of x (``y.copy_(x)``)
  aten      ``torch.ops.aten._fused_rms_norm`` forward and ``_fused_rms_norm_backward``
            (dx and dw), i.e. ATen's own CUDA kernels
  compiled  the same two ops through ``torch.compile`` of the reference composite
Prints a table (microseconds, and time over the copy time of the same bytes) and writes
``$OUT/aten_baseline.json`` when OUT is set. Run on the GPU machine:
``python3 crates/graft-cuda/bench/aten_baseline.py``.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable

import torch

SHAPES: list[tuple[int, int]] = [(32768, 4096), (8192, 4096)]
SETS = 3
EPS = 1e-6


def median_us(fn: Callable[[int], object], reps: int, warmup: int = 5) -> float:
    """Median microseconds of ``fn(i)`` over ``reps`` event-timed calls after a warm-up."""
    for i in range(warmup):
        fn(i)
    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for i, (a, b) in enumerate(pairs):
        a.record()
        fn(warmup + i)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)


def reference_forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The composite forward (as in torch/_decomp) for torch.compile to fuse."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * rstd * w.float()).to(x.dtype), rstd


def reference_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The composite backward (dx and dw) for torch.compile to fuse."""
    xf, gf, wf = x.float(), dy.float(), w.float()
    xhat = xf * rstd
    g = gf * wf
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    dw = (gf * xhat).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


def time_shape(rows: int, cols: int, fwd_c: Callable, bwd_c: Callable) -> list[dict[str, object]]:
    """Times every baseline at one shape."""
    dev = torch.device("cuda")
    reps = 40 if rows >= 32768 else 100
    xs = [torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
    dys = [torch.randn_like(xs[0]) for _ in range(SETS)]
    ys = [torch.empty_like(xs[0]) for _ in range(SETS)]
    w = torch.rand(cols, device=dev, dtype=torch.bfloat16) + 0.5
    rstds = [torch.ops.aten._fused_rms_norm(x, [cols], w, EPS)[1] for x in xs]
    aten_fwd = torch.ops.aten._fused_rms_norm
    aten_bwd = torch.ops.aten._fused_rms_norm_backward
    timed: list[tuple[str, Callable[[int], object], float]] = [
        ("copy", lambda i: ys[i % SETS].copy_(xs[i % SETS]), 2),
        ("aten fwd", lambda i: aten_fwd(xs[i % SETS], [cols], w, EPS), 2),
        (
            "aten bwd",
            lambda i: aten_bwd(
                dys[i % SETS], xs[i % SETS], [cols], rstds[i % SETS], w, [True, True]
            ),
            3,
        ),
        ("compiled fwd", lambda i: fwd_c(xs[i % SETS], w), 2),
        ("compiled bwd", lambda i: bwd_c(dys[i % SETS], xs[i % SETS], rstds[i % SETS], w), 3),
    ]
    shape = f"{rows}x{cols}"
    return [
        {"shape": shape, "op": op, "median_us": median_us(fn, reps), "passes": passes}
        for op, fn, passes in timed
    ]


def main() -> None:
    """Times every baseline at every shape and prints the table."""
    fwd_c = torch.compile(reference_forward)
    bwd_c = torch.compile(reference_backward)
    results: list[dict[str, object]] = []
    for rows, cols in SHAPES:
        results += time_shape(rows, cols, fwd_c, bwd_c)
        torch.cuda.empty_cache()

    print(f"{'shape':<11} {'op':<13} {'med us':>9} {'xcopy':>7}")
    for r in results:
        copy = next(c for c in results if c["shape"] == r["shape"] and c["op"] == "copy")
        ratio = float(r["median_us"]) / (float(copy["median_us"]) * float(r["passes"]) / 2)
        r["xcopy"] = ratio
        print(f"{r['shape']:<11} {r['op']:<13} {float(r['median_us']):>9.1f} {ratio:>7.3f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "aten_baseline.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
