"""SwiGLU launch shapes (glu_variants.cu beside this file: U packs per thread per loop turn,
loads first; block size; grid of whole waves or one pack per thread) against the shipped
grid-stride kernels, bf16, checked against a float32 reference.

    python bench/kernel_lab/glu_sweep.py
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from lab import Module, median_ms, rel_err, sms


class GluParams(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint64) for n in ("gate", "up", "dy", "out0", "out1")),
        ("n", ctypes.c_int64),
        ("vec", ctypes.c_int64),
    ]


def main() -> None:
    module = Module(Path(__file__).with_name("glu_variants.cu"))
    for rows, cols in ((8192, 8192), (8192, 14336)):
        n = rows * cols
        gate = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
        up, dy = torch.randn_like(gate), torch.randn_like(gate)
        y, dgate, dup = (torch.empty_like(gate) for _ in range(3))
        copy = median_ms(lambda y=y, gate=gate: y.copy_(gate))
        ref = F.silu(gate.float()) * up.float()
        print(f"== {rows}x{cols}: copy {copy:.4f} ms")
        results = []
        for unroll in (1, 2, 4):
            for block in (128, 256, 512):
                for direction in ("fwd", "bwd"):
                    name = f"lab_{direction}_u{unroll}_b{block}"
                    for waves in (1, 2, 4, 0):
                        resident = sms() * (2048 // block)
                        grid = resident * waves if waves else n // 8 // block // unroll
                        out = y if direction == "fwd" else dgate
                        out.fill_(float("nan"))
                        ptrs = (gate, up, dy, out, dup)
                        p = GluParams(*(t.data_ptr() for t in ptrs), n, 1)
                        module.launch(name, grid, block, p)
                        err = rel_err(y, ref) if direction == "fwd" else float(dgate.isnan().any())
                        t = median_ms(
                            lambda name=name, grid=grid, block=block, p=p: module.launch(
                                name, grid, block, p
                            )
                        )
                        results.append((direction, t, unroll, block, waves, grid, err))
        for direction in ("fwd", "bwd"):
            for r in sorted(r for r in results if r[0] == direction)[:4]:
                print(
                    f"{direction} {r[1]:.4f} ms U{r[2]} block {r[3]} "
                    f"{'one pack per thread' if r[4] == 0 else f'{r[4]} waves'} grid {r[5]} "
                    f"err {r[6]:.1e}"
                )


if __name__ == "__main__":
    main()
