"""LayerNorm backward launch shapes (ops/layer_norm/layer_norm.cu rows kernels + finalize): every
vector width V, rows per block, grid size and staging (the next x and dy rows copied into a
second shared memory buffer ahead, or rows loaded straight to registers) that the launch bounds
allow, and the bulk kernel (clusters of 4, as many as can be resident) where a block's slice
fits it, at hidden 2048, 4096 and 8192 (bf16, 128 M elements) or the given sizes, checked
against ATen's backward and timed against the three-pass floor.

    python bench/kernel_lab/layer_norm_sweep.py [source.cu] [--hidden 6208,8192]
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from lab import KERNELS, Module, median_ms, rel_err, sms
from softmax_bulk_sweep import max_clusters

U64, I64 = ctypes.c_uint64, ctypes.c_int64
BOUNDS = {1: 512, 2: 512, 4: 256}  # 16-bit vector backward kernels' launch bounds
BULK = (4, 128, 2)  # the bulk kernel's cluster size, threads and units a thread


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("x", "w", "b", "y", "mean", "rstd", "dy", "dx", "partial")),
        *((n, I64) for n in ("rows", "cols", "tpr", "rpb", "vec", "stage")),
        ("eps", ctypes.c_double),
        ("inv_cols", ctypes.c_double),
    ]


class FinalizeParams(ctypes.Structure):
    _fields_ = [("partial", U64), ("dw", U64), ("db", U64), ("nparts", I64), ("cols", I64)]


def sweep(module: Module, cols: int) -> None:
    """Every launch shape at one hidden size; prints the eight fastest."""
    rows = 2**27 // cols
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.randn(cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dy = torch.randn_like(x)
    copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
    ref = torch.ops.aten.native_layer_norm_backward(
        dy, x, [cols], mean, rstd, w, b, [True, True, True]
    )
    floor = 1.5 * copy  # read x and dy, write dx
    print(f"== {rows}x{cols}: copy {copy:.4f} ms, three-pass floor {floor:.4f} ms")
    results = []

    def measure(label: str, name: str, grid: int, block: int, smem: int, nparts: int, **kw) -> None:
        if smem > 48 * 1024:
            module.allow_shared_memory(name, smem)
        dx = torch.full_like(x, float("nan"))
        dw, db = torch.full_like(w, float("nan")), torch.full_like(b, float("nan"))
        part = torch.full((nparts, 2 * cols), float("nan"), device="cuda")
        ptrs = (x, w, None, None, mean, rstd, dy, dx, part)
        p = Params(*(t.data_ptr() if t is not None else 0 for t in ptrs))
        p.rows, p.cols, p.vec, p.eps, p.inv_cols = rows, cols, 1, 1e-5, 1.0 / cols
        for k, v in kw.items():
            setattr(p, k, v)
        fp = FinalizeParams(part.data_ptr(), dw.data_ptr(), db.data_ptr(), nparts, cols)

        def call() -> None:
            module.launch(name, grid, block, p, smem)
            # The library's finalize: 32 columns per block of 256 threads.
            module.launch("graft_ln_finalize_bf16", fp.cols // 32 + 1, 256, fp)

        try:
            call()
            torch.cuda.synchronize()
        except RuntimeError as error:
            print(f"{label}: {error}")
            return
        err = max(rel_err(o, r) for o, r in zip((dx, dw, db), ref, strict=True))
        results.append((median_ms(call), label, err))

    for v, bound in BOUNDS.items():
        tpr = cols // 8 // v
        for rpb in (1, 2, 4):
            if tpr * rpb > bound or (tpr * rpb) % 32:
                continue
            for stage in (0, 1):
                partial_smem = (rpb - 1) * tpr * v * 8 * 4 * 2
                smem = max(partial_smem, stage * 4 * rpb * v * tpr * 16)
                if smem > 200 * 1024:
                    continue
                for per_sm in (1, 2, 3, 4):
                    grid = min(rows // rpb, sms() * per_sm)
                    label = f"V{v} tpr{tpr} rpb{rpb} stage{stage} grid{grid} smem{smem}"
                    name = f"graft_ln_bwd_rows_v{v}_bf16"
                    measure(label, name, grid, tpr * rpb, smem, grid, tpr=tpr, rpb=rpb, stage=stage)
    c, threads, v = BULK
    per = -(-cols // 8 // c)
    if per <= v * threads:
        name = "graft_ln_bwd_bulk_bf16"
        smem = 4 * per * 16
        clusters = max_clusters(module, name, c, threads, smem)
        label = f"bulk: clusters of {c}, {threads} threads, grid {clusters * c}, smem{smem}"
        measure(label, name, clusters * c, threads, smem, clusters)
    for t, label, err in sorted(results)[:8]:
        print(f"{t:.4f} ms ({t / floor:.3f}x floor) {label}; worst error vs ATen {err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", nargs="?", default=KERNELS / "layer_norm" / "layer_norm.cu")
    parser.add_argument("--hidden", default="2048,4096,8192")
    args = parser.parse_args()
    module = Module(args.source)
    for cols in map(int, args.hidden.split(",")):
        sweep(module, cols)


if __name__ == "__main__":
    main()
