"""Softmax / log-softmax on persistent clusters with bulk copies and pushed partials
(softmax_bulk.cu beside this file: the lab versions of the library's bulk kernels) against the
split and loop kernels of ops/softmax/softmax.cu, bf16, 128 M elements, at 32k-256k columns. Each
output is checked against ATen; times against a copy (forward) or 1.5 copies (backward: three
tensors).

The bulk kernels run one resident wave: clusters as cuOccupancyMaxActiveClusters reports (a
row's blocks wait for each other, so a cluster that had to wait for a free GPC would stall the
rows assigned to it).

    python bench/kernel_lab/softmax_bulk_sweep.py [--log] [--widths 65536,131072]
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch
from lab import KERNELS, Module, median_ms, rel_err, sms

U32, U64, I64 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64


class Params(ctypes.Structure):
    _fields_ = [
        *((n, U64) for n in ("in0", "in1", "out")),
        *((n, I64) for n in ("outer", "dim", "inner", "tpr", "rpb", "vec", "log", "stage")),
    ]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (no launch attributes: the kernels declare their cluster size)."""

    _fields_ = [
        *((n, U32) for n in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")),
        ("shared_bytes", U32),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", U32),
    ]


def max_clusters(module: Module, name: str, c: int, threads: int, smem: int) -> int:
    """How many clusters of ``name`` (blocks, for C = 1) can be resident at once."""
    f = module.function(name)
    n = ctypes.c_int()
    if c == 1:
        code = module._cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), f, threads, ctypes.c_size_t(smem)
        )
        if code != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: error {code}")
        return n.value * sms()
    cfg = LaunchConfig(c, 1, 1, threads, 1, 1, smem, None, None, 0)
    code = module._cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), f, ctypes.byref(cfg))
    if code != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters({name}): CUDA driver error {code}")
    return n.value


def measure(
    module: Module,
    name: str,
    grid: int,
    threads: int,
    smem: int,
    ins: tuple[torch.Tensor, torch.Tensor],
    ref: torch.Tensor,
    log: int,
) -> tuple[float, str, float]:
    """Median ms of one launch of ``name``, what it was, and its error against ``ref``."""
    rows, cols = ref.shape
    out = torch.full_like(ref, float("nan"))
    p = Params(ins[0].data_ptr(), ins[1].data_ptr(), out.data_ptr())
    p.outer, p.dim, p.inner, p.tpr, p.rpb = rows, cols, 1, threads, 1
    p.vec, p.log, p.stage = 1, log, 1
    module.allow_shared_memory(name, smem)

    def call() -> None:
        module.launch(name, grid, threads, p, smem)

    call()
    torch.cuda.synchronize()
    return median_ms(call), f"{name} {threads}t grid {grid}", rel_err(out, ref)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", action="store_true", help="log-softmax")
    parser.add_argument("--widths", default="32768,65536,131072,262144")
    args = parser.parse_args()
    log = int(args.log)
    split = Module(KERNELS / "softmax" / "softmax.cu")
    bulk = Module(Path(__file__).resolve().parent / "softmax_bulk.cu")
    room = torch.cuda.get_device_properties(0).shared_memory_per_block_optin - 1024
    fwd_op = torch.log_softmax if log else torch.softmax
    bwd_op = (
        torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    )
    for cols in map(int, args.widths.split(",")):
        rows = 2**27 // cols
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 4
        y_ref = fwd_op(x, -1)
        dy = torch.randn_like(x)
        dx_ref = bwd_op(dy, y_ref, -1, torch.bfloat16)
        copy = median_ms(lambda x=x: torch.empty_like(x).copy_(x))
        print(f"== {rows}x{cols}, {'log-' if log else ''}softmax: copy {copy:.4f} ms")
        for d in ("fwd", "bwd"):
            arrays = 2 if d == "bwd" else 1
            floor = copy * 1.5 if d == "bwd" else copy
            ins, ref = ((dy, y_ref), dx_ref) if d == "bwd" else ((x, x), y_ref)
            results = []
            for c in (1, 2, 4, 8):
                slice_bytes = -(-cols // (8 * c)) * 16 * arrays
                for threads in (256, 512):
                    if slice_bytes <= room:  # the split kernels, one row per cluster
                        kind = "loop" if c == 1 else f"split{c}"
                        name = f"graft_softmax_{d}_{kind}_bf16"
                        results.append(
                            measure(split, name, rows * c, threads, slice_bytes, ins, ref, log)
                        )
                    if 2 * slice_bytes <= room:  # two buffers
                        for push in (
                            ("", "_push", "_push2", "_push3")
                            if d == "fwd" and c > 1
                            else ("", "_push")
                        ):
                            name = f"graft_softmax_bulk_{d}{c}{push}"
                            bulk.allow_shared_memory(name, 2 * slice_bytes)
                            clusters = max_clusters(bulk, name, c, threads, 2 * slice_bytes)
                            results.append(
                                measure(
                                    bulk,
                                    name,
                                    clusters * c,
                                    threads,
                                    2 * slice_bytes,
                                    ins,
                                    ref,
                                    log,
                                )
                            )
            for t, what, err in sorted(results)[:6]:
                print(f"  {d} {floor / t:.3f} of copy ({t:.4f} ms) {what}; error vs ATen {err:.1e}")
            worst = max(r[2] for r in results)
            print(f"  {d} worst error vs ATen over all {len(results)} launches: {worst:.1e}")


if __name__ == "__main__":
    main()
