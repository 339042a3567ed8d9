"""LayerNorm forward launch shapes (ops/layer_norm/layer_norm.cu): the rows kernels' vector widths V
and rows per block, and the staged kernel's block sizes, at hidden 1024 to 8192 (bf16, 128 M
elements); y, mean and rstd checked against ATen, times against a copy. Prints the best
shapes, the rows kernels' at target block sizes of 128 and 256 threads (src/layer_norm.rs
`FWD_TARGET_BLOCK`) and the staged kernel's.

    python bench/kernel_lab/layer_norm_fwd_sweep.py [--hidden 4096,8192,32768]
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from lab import KERNELS, Module, median_ms, rel_err

U64, I64 = ctypes.c_uint64, ctypes.c_int64
BOUNDS = {1: 1024, 2: 1024, 4: 512, 8: 256}  # 16-bit vector kernels' launch bounds


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("x", "w", "b", "y", "mean", "rstd", "dy", "dx", "partial")),
        *((n, I64) for n in ("rows", "cols", "tpr", "rpb", "vec", "stage")),
        ("eps", ctypes.c_double),
        ("inv_cols", ctypes.c_double),
    ]


def sweep(module: Module, cols: int) -> None:
    """Every launch shape at one hidden size; prints the best and the planner's."""
    rows = 2**27 // cols
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w, b = (torch.randn(cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
    ref = [t.reshape(-1) for t in torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)]
    print(f"== {rows}x{cols}: copy {copy:.4f} ms")
    results = {}

    def measure(label: str, name: str, grid: int, block: int, tpr: int, rpb: int) -> None:
        y = torch.full_like(x, float("nan"))
        mean = torch.full((rows,), float("nan"), device="cuda")
        rstd = torch.full_like(mean, float("nan"))
        ptrs = (x, w, b, y, mean, rstd, None, None, None)
        p = Params(*(t.data_ptr() if t is not None else 0 for t in ptrs))
        p.rows, p.cols, p.tpr, p.rpb, p.vec = rows, cols, tpr, rpb, 1
        p.eps, p.inv_cols = 1e-5, 1.0 / cols
        smem = cols * 2 if "staged" in name else 0
        if smem > 48 * 1024:
            module.allow_shared_memory(name, smem)

        def call() -> None:
            module.launch(name, grid, block, p, smem)

        call()
        torch.cuda.synchronize()
        outs = (y.reshape(-1), mean, rstd)
        err = max(rel_err(o, r) for o, r in zip(outs, ref, strict=True))
        results[label] = (median_ms(call), err)

    for v, bound in BOUNDS.items():
        tpr = cols // 8 // v
        for rpb in (1, 2, 4, 8, 16):
            if tpr * rpb > bound or (tpr * rpb) % 32:
                continue
            grid = rows // rpb
            label = f"rows V{v} tpr{tpr} rpb{rpb}"
            measure(label, f"graft_ln_fwd_rows_v{v}_bf16", grid, tpr * rpb, tpr, rpb)
    for threads in (64, 128, 256, 512):
        label = f"staged {threads}t"
        measure(label, "graft_ln_fwd_staged_bf16", rows, threads, threads, 1)
    for t, err, label in sorted((t, e, k) for k, (t, e) in results.items())[:4]:
        print(f"  {t:.4f} ms ({t / copy:.3f}x copy) {label}; error vs ATen {err:.1e}")
    v = 4  # the planner's preferred V; rows per block from the target block size
    for target in (64, 128, 256):
        tpr = cols // 8 // v
        rpb = max(1, target // tpr)
        if (label := f"rows V{v} tpr{tpr} rpb{rpb}") in results:  # not beyond the rows kernels
            t, _ = results[label]
            print(f"  rows target {target}: {t:.4f} ms ({t / copy:.3f}x copy) V{v} rpb{rpb}")
    for threads in (64, 128, 256, 512):
        t, _ = results[f"staged {threads}t"]
        print(f"  staged {threads}t: {t:.4f} ms ({t / copy:.3f}x copy)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", default="1024,2048,4096,8192")
    args = parser.parse_args()
    module = Module(KERNELS / "layer_norm" / "layer_norm.cu")
    for cols in map(int, args.hidden.split(",")):
        sweep(module, cols)


if __name__ == "__main__":
    main()
