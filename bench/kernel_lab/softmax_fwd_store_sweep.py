"""The forward bulk kernel's two store modes (softmax_fwd_store.cu beside this file) at 256
and 512 threads, against a copy and the library's op, bf16 softmax and log-softmax, 128 M
elements, 65536, 131072 and 262144 columns (clusters of 2, 4 and 8). Each case runs ``--runs``
times in turn; prints every run's fraction of a copy's bandwidth and each case's mean.
Outputs are checked against a float64 reference. What src/softmax.rs `fwd_bulk_threads` and
the kernels' store modes were chosen by.

    python bench/kernel_lab/softmax_fwd_store_sweep.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import torch
from lab import Module, median_ms, rel_err
from softmax_bulk_sweep import Params, max_clusters

import torchgraft

CLUSTER = {65536: 2, 131072: 4, 262144: 8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    module = Module(Path(__file__).resolve().parent / "softmax_fwd_store.cu")
    ratios: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    worst = 0.0
    for _ in range(args.runs):
        for log in (True, False):
            op = torch.log_softmax if log else torch.softmax
            what = "log-softmax" if log else "softmax"
            for cols, c in CLUSTER.items():
                rows = 2**27 // cols
                x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
                ref = op(x.double(), -1)
                copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
                os.environ["TORCHGRAFT_CUDA_SOFTMAX"] = "always"
                torchgraft.enable()
                lib = median_ms(lambda x=x, op=op: op(x, -1))
                worst = max(worst, rel_err(op(x, -1), ref))
                torchgraft.disable()
                ratios[(what, cols, "library op")].append(copy / lib)
                smem = 2 * cols * 2 // c  # two buffers of the block's slice
                for store in ("threads", "bulk"):
                    name = f"lab_fwd{c}_{store}"
                    module.allow_shared_memory(name, smem)
                    for threads in (256, 512):
                        grid = min(max_clusters(module, name, c, threads, smem), rows) * c
                        out = torch.full_like(x, float("nan"))
                        p = Params(x.data_ptr(), x.data_ptr(), out.data_ptr())
                        p.outer, p.dim, p.inner, p.tpr, p.rpb = rows, cols, 1, threads, 1
                        p.vec, p.log, p.stage = 1, int(log), 1

                        def call(name=name, grid=grid, threads=threads, p=p, smem=smem) -> None:
                            module.launch(name, grid, threads, p, smem)

                        t = median_ms(call)
                        worst = max(worst, rel_err(out, ref))
                        key = f"{store} stores, {threads} threads, grid {grid}"
                        ratios[(what, cols, key)].append(copy / t)
                del x, ref
                torch.cuda.empty_cache()
    for what in ("log-softmax", "softmax"):
        for cols, c in CLUSTER.items():
            print(f"== {what}, {2**27 // cols}x{cols} (clusters of {c}): fraction of copy")
            cases = [(k[2], v) for k, v in ratios.items() if k[:2] == (what, cols)]
            for key, v in sorted(cases, key=lambda kv: -sum(kv[1]) / len(kv[1])):
                runs = " ".join(f"{r:.3f}" for r in v)
                print(f"  mean {sum(v) / len(v):.3f} ({runs}) {key}")
    print(f"worst error vs float64 over all launches: {worst:.1e}")


if __name__ == "__main__":
    main()
