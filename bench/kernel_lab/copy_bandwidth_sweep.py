"""Device copy bandwidth at the sizes one RoPE kernel moves: torch's ``copy_`` of float32 and
bfloat16 against the copy kernels of copy_bandwidth.cu (packs in flight per thread, grid shape).
The memory floors of ``torchgraft bench`` (``harness.floor_call``) are torch float32 copies;
this checks that no copy kernel is faster.

    python bench/kernel_lab/copy_bandwidth_sweep.py
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from lab import Module, median_ms, sms

BLOCK = 256


class CopyParams(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("n", ctypes.c_int64)]


def copy_bytes(megabytes: int) -> int:
    """``megabytes`` MB, rounded down to whole 4 KiB."""
    return megabytes * 1_000_000 // 4096 * 4096


def sweep(module: Module, megabytes: int) -> dict[str, float]:
    """Median ms of each copy of ``megabytes`` MB (read, and as much written)."""
    nbytes = copy_bytes(megabytes)
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    half_src, half_dst = src.view(torch.bfloat16), dst.view(torch.bfloat16)
    results = {
        "torch copy_ float32": median_ms(lambda: dst.copy_(src)),
        "torch copy_ bfloat16": median_ms(lambda: half_dst.copy_(half_src)),
    }
    packs = nbytes // 16
    params = CopyParams(src.data_ptr(), dst.data_ptr(), packs)
    launches = {
        f"covering, {u} packs a thread": (f"copy_cover_u{u}", -(-packs // (BLOCK * u)))
        for u in (1, 2, 4, 8)
    }
    for u in (4, 8):
        for per_sm in (2, 4, 8):
            launches[f"grid-stride, {u} packs, {per_sm} blocks/SM"] = (
                f"copy_stride_u{u}",
                sms() * per_sm,
            )
    for what, (name, grid) in launches.items():
        dst.fill_(float("nan"))
        module.launch(name, grid, BLOCK, params)
        assert torch.equal(dst, src), what

        def launch(name: str = name, grid: int = grid) -> None:
            module.launch(name, grid, BLOCK, params)

        results[what] = median_ms(launch)
    return results


def main() -> None:
    module = Module(Path(__file__).with_name("copy_bandwidth.cu"))
    for megabytes in (42, 86, 172):
        print(f"== {megabytes} MB read and {megabytes} MB written")
        nbytes = copy_bytes(megabytes)
        for what, ms in sweep(module, megabytes).items():
            print(f"{what:36s} {ms * 1e3:7.2f} us  {2 * nbytes / ms / 1e9:5.2f} TB/s")


if __name__ == "__main__":
    main()
