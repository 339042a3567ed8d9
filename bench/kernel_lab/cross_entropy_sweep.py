"""Cross-entropy rows kernel launch shapes (ops/cross_entropy/cross_entropy.cu, `graft_ce_rows_*`):
1024-thread block, two 512-thread or four 256-thread blocks per SM, at 8192 x 128256 (bf16),
loss alone and loss with the gradient written over the logits; three alternating rounds of
medians. The loss is checked against ``F.cross_entropy`` once per shape.

    python bench/kernel_lab/cross_entropy_sweep.py
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from lab import KERNELS, Module, median_ms, rel_err, sms

U64, I64, F64 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_double


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("logits", "target", "grad", "loss", "count", "row_scale")),
        *((n, I64) for n in ("rows", "cols", "ignore_index")),
        ("on_target", F64),
        ("per_class", F64),
        ("smoothing", I64),
    ]


def main() -> None:
    module = Module(KERNELS / "cross_entropy" / "cross_entropy.cu")
    rows, cols = 8192, 128256
    logits = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, cols, (rows,), device="cuda")
    want = F.cross_entropy(logits.float(), target, reduction="none")
    loss = torch.empty(rows, device="cuda")
    shapes = [(sms() * k, 1024 // k) for k in (1, 2, 4)]
    for grid, block in shapes:
        p = Params(logits.data_ptr(), target.data_ptr(), 0, loss.data_ptr(), 0, 0, rows, cols)
        p.ignore_index, p.on_target, p.per_class, p.smoothing = -100, 1.0, 0.0, 0
        loss.fill_(float("nan"))
        module.launch("graft_ce_rows_bf16", grid, block, p)
        print(f"{grid}x{block}: loss error vs F.cross_entropy {rel_err(loss, want):.1e}")
    times: dict[str, list[float]] = {}
    for _ in range(3):
        for grid, block in shapes:
            for grad in (False, True):
                # The gradient over the logits: later calls run on the previous call's gradient,
                # which costs the same.
                p = Params(logits.data_ptr(), target.data_ptr(), logits.data_ptr() if grad else 0)
                p.loss, p.rows, p.cols, p.ignore_index = loss.data_ptr(), rows, cols, -100
                p.on_target, p.per_class = 1.0, 0.0

                def call(grid=grid, block=block, p=p) -> None:
                    module.launch("graft_ce_rows_bf16", grid, block, p)

                key = f"{grid}x{block} {'loss + gradient' if grad else 'loss'}"
                times.setdefault(key, []).append(median_ms(call, samples=10, calls=5))
    for key, ts in times.items():
        print(f"{key}: " + " / ".join(f"{t:.3f}" for t in ts) + " ms")


if __name__ == "__main__":
    main()
