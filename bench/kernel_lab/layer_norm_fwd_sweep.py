"""LayerNorm forward launch shapes (kernels/layer_norm.cu rows kernels): vector widths V, rows
per block and grid sizes, at hidden 1024 to 8192 (bf16, 128 M elements); y, mean and rstd
checked against ATen, times against a copy. Prints the best shapes and the ones that target
block sizes of 128 and 256 threads give (src/layer_norm.rs `FWD_TARGET_BLOCK`).

    python bench/kernel_lab/layer_norm_fwd_sweep.py
"""

from __future__ import annotations

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


def main() -> None:
    module = Module(KERNELS / "layer_norm.cu")
    for cols in (1024, 2048, 4096, 8192):
        rows = 2**27 // cols
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3 + 1
        w, b = (torch.randn(cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
        ref = [t.reshape(-1) for t in torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)]
        print(f"== {rows}x{cols}: copy {copy:.4f} ms")
        results = {}
        for v, bound in BOUNDS.items():
            tpr = cols // 8 // v
            for rpb in (1, 2, 4, 8, 16):
                if tpr * rpb > bound or (tpr * rpb) % 32:
                    continue
                name = f"graft_ln_fwd_rows_v{v}_bf16"
                grid = rows // rpb
                y = torch.full_like(x, float("nan"))
                mean = torch.full((rows,), float("nan"), device="cuda")
                rstd = torch.full_like(mean, float("nan"))
                ptrs = (x, w, b, y, mean, rstd, None, None, None)
                p = Params(*(t.data_ptr() if t is not None else 0 for t in ptrs))
                p.rows, p.cols, p.tpr, p.rpb, p.vec = rows, cols, tpr, rpb, 1
                p.eps, p.inv_cols = 1e-5, 1.0 / cols

                def call(name=name, grid=grid, block=tpr * rpb, p=p) -> None:
                    module.launch(name, grid, block, p)

                call()
                torch.cuda.synchronize()
                outs = (y.reshape(-1), mean, rstd)
                err = max(rel_err(o, r) for o, r in zip(outs, ref, strict=True))
                results[(v, rpb)] = (median_ms(call), tpr, err)
        for t, v, rpb, tpr, err in sorted(
            (t, v, rpb, tpr, e) for (v, rpb), (t, tpr, e) in results.items()
        )[:3]:
            print(
                f"  {t:.4f} ms ({t / copy:.3f}x copy) V{v} tpr{tpr} rpb{rpb} "
                f"error vs ATen {err:.1e}"
            )
        v = 4  # the planner's preferred V; rows per block from the target block size
        for target in (128, 256):
            tpr = cols // 8 // v
            rpb = max(1, target // tpr)
            t, _, _ = results[(v, rpb)]
            print(f"  target {target}: {t:.4f} ms ({t / copy:.3f}x copy) V{v} rpb{rpb}")


if __name__ == "__main__":
    main()
