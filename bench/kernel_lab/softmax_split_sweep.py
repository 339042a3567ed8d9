"""Softmax launch shapes at wide rows (ops/softmax/softmax.cu): the loop kernel (C = 1) against the
split kernels (a row over a cluster of C blocks, sm_90+), block sizes, and the rows kernel
where it applies, at widths 16k to 256k (bf16, 128 M elements). Each output is checked against
ATen, times against a copy (forward) or 1.5 copies (backward: three tensors move).

    python bench/kernel_lab/softmax_split_sweep.py [--log]
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from lab import KERNELS, Module, median_ms, rel_err, sms

U64, I64 = ctypes.c_uint64, ctypes.c_int64


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("in0", "in1", "out")),
        *((n, I64) for n in ("outer", "dim", "inner", "tpr", "rpb", "vec", "log", "stage")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", action="store_true", help="log-softmax")
    parser.add_argument("--widths", default="16384,32768,65536,131072,262144")
    args = parser.parse_args()
    module = Module(KERNELS / "softmax" / "softmax.cu")
    room = torch.cuda.get_device_properties(0).shared_memory_per_block_optin - 1024
    log = int(args.log)
    for cols in map(int, args.widths.split(",")):
        rows = 2**27 // cols
        nunits = cols // 8
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 4
        y_ref = (torch.log_softmax if log else torch.softmax)(x, -1)
        dy = torch.randn_like(x)
        op = torch.ops.aten._log_softmax_backward_data if log else None
        op = op or torch.ops.aten._softmax_backward_data
        dx_ref = op(dy, y_ref, -1, torch.bfloat16)
        copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
        fwd_op = torch.log_softmax if log else torch.softmax
        aten_f = median_ms(lambda x=x, f=fwd_op: f(x, -1))
        aten_b = median_ms(lambda op=op, dy=dy, y=y_ref: op(dy, y, -1, torch.bfloat16))
        print(
            f"== {rows}x{cols}: copy {copy:.4f} ms; ATen fwd {copy / aten_f:.3f} "
            f"bwd {1.5 * copy / aten_b:.3f} of copy"
        )
        for bwd in (False, True):
            arrays = 2 if bwd else 1
            d = "bwd" if bwd else "fwd"
            floor = copy * (1.5 if bwd else 1.0)
            results = []
            for c in (1, 2, 4, 8):
                stage_bytes = nunits * 16 * arrays // c
                if stage_bytes > room:
                    continue
                name = f"graft_softmax_{d}_{'loop' if c == 1 else f'split{c}'}_bf16"
                module.allow_shared_memory(name, stage_bytes)
                for threads in (128, 256, 512):
                    out = torch.full_like(x, float("nan"))
                    ins = (dy, y_ref) if bwd else (x, x)
                    p = Params(ins[0].data_ptr(), ins[1].data_ptr(), out.data_ptr())
                    p.outer, p.dim, p.inner, p.tpr, p.rpb = rows, cols, 1, threads, 1
                    p.vec, p.log, p.stage = 1, log, 1
                    grids = {"one row per cluster": rows * c}
                    if c == 1:
                        grids["persistent"] = sms() * max(1, 2048 // threads)

                    for how, grid in grids.items():

                        def call(name=name, grid=grid, threads=threads, p=p, smem=stage_bytes):
                            module.launch(name, grid, threads, p, smem)

                        call()
                        torch.cuda.synchronize()
                        err = rel_err(out, dx_ref if bwd else y_ref)
                        t = median_ms(call)
                        results.append((t, c, threads, how, err))
            if not bwd and nunits <= 4096:
                tpr = nunits // 4
                out = torch.full_like(x, float("nan"))
                p = Params(x.data_ptr(), 0, out.data_ptr())
                p.outer, p.dim, p.inner, p.tpr, p.rpb, p.vec, p.log = rows, cols, 1, tpr, 1, 1, log

                def rows_call(p=p, tpr=tpr, rows=rows) -> None:
                    module.launch("graft_softmax_fwd_rows_v4_bf16", rows, tpr, p)

                rows_call()
                torch.cuda.synchronize()
                err = rel_err(out, y_ref)
                results.append((median_ms(rows_call), 0, tpr, "rows kernel V4", err))
            for t, c, threads, how, err in sorted(results)[:6]:
                print(
                    f"  {d} {floor / t:.3f} of copy ({t:.4f} ms) C{c} {threads} threads, {how}; "
                    f"error vs ATen {err:.1e}"
                )
            worst = max(r[4] for r in results)
            print(f"  {d} worst error vs ATen over all {len(results)} shapes: {worst:.1e}")


if __name__ == "__main__":
    main()
