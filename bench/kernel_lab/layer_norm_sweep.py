"""LayerNorm backward launch shapes (kernels/layer_norm.cu rows kernels + finalize): every
vector width V, rows per block, grid size and staging (the next x and dy rows copied into a
second shared memory buffer ahead, or rows loaded straight to registers) that the launch bounds
allow, at hidden 2048, 4096 and 8192 (bf16), checked against ATen's backward and timed against
the three-pass floor.

    python bench/kernel_lab/layer_norm_sweep.py [source.cu]
"""

from __future__ import annotations

import ctypes
import sys

import torch
from lab import KERNELS, Module, median_ms, rel_err, sms

U64, I64 = ctypes.c_uint64, ctypes.c_int64
BOUNDS = {1: 512, 2: 512, 4: 256}  # 16-bit vector backward kernels' launch bounds


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("x", "w", "b", "y", "mean", "rstd", "dy", "dx", "partial")),
        *((n, I64) for n in ("rows", "cols", "tpr", "rpb", "vec", "stage")),
        ("eps", ctypes.c_double),
        ("inv_cols", ctypes.c_double),
    ]


class FinalizeParams(ctypes.Structure):
    _fields_ = [("partial", U64), ("dw", U64), ("db", U64), ("nparts", I64), ("cols", I64)]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    module = Module(args[0] if args else KERNELS / "layer_norm.cu")
    for rows, cols in ((32768, 2048), (32768, 4096), (16384, 8192)):
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
        for v, bound in BOUNDS.items():
            tpr = cols // 8 // v
            for rpb in (1, 2, 4):
                if tpr * rpb > bound or (tpr * rpb) % 32:
                    continue
                name = f"graft_ln_bwd_rows_v{v}_bf16"
                for stage in (0, 1):
                    partial_smem = (rpb - 1) * tpr * v * 8 * 4 * 2
                    smem = max(partial_smem, stage * 4 * rpb * v * tpr * 16)
                    if smem > 200 * 1024:
                        continue
                    if smem > 48 * 1024:
                        module.allow_shared_memory(name, smem)
                    for per_sm in (1, 2, 3, 4):
                        grid = min(rows // rpb, sms() * per_sm)
                        dx = torch.full_like(x, float("nan"))
                        dw, db = torch.full_like(w, float("nan")), torch.full_like(b, float("nan"))
                        part = torch.empty(grid, 2 * cols, device="cuda")
                        ptrs = (x, w, None, None, mean, rstd, dy, dx, part)
                        p = Params(*(t.data_ptr() if t is not None else 0 for t in ptrs))
                        p.rows, p.cols, p.tpr, p.rpb = rows, cols, tpr, rpb
                        p.vec, p.stage = 1, stage
                        p.eps, p.inv_cols = 1e-5, 1.0 / cols
                        fp = FinalizeParams(
                            part.data_ptr(), dw.data_ptr(), db.data_ptr(), grid, cols
                        )

                        def call(name=name, grid=grid, block=tpr * rpb, p=p, smem=smem, fp=fp):
                            module.launch(name, grid, block, p, smem)
                            # The library's finalize: 32 columns per block of 256 threads.
                            module.launch("graft_ln_finalize_bf16", fp.cols // 32 + 1, 256, fp)

                        try:
                            call()
                            torch.cuda.synchronize()
                        except RuntimeError as error:
                            print(f"V{v} rpb{rpb} stage{stage} grid{grid}: {error}")
                            continue
                        outs = (dx, dw, db)
                        err = max(rel_err(o, r) for o, r in zip(outs, ref, strict=True))
                        results.append((median_ms(call), v, tpr, rpb, stage, grid, smem, err))
        for t, v, tpr, rpb, stage, grid, smem, err in sorted(results)[:8]:
            print(
                f"{t:.4f} ms ({t / floor:.3f}x floor) V{v} tpr{tpr} rpb{rpb} stage{stage} "
                f"grid{grid} smem{smem} worst error vs ATen {err:.1e}"
            )


if __name__ == "__main__":
    main()
