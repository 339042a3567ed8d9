"""Compiles the cuTile RMSNorm kernels (and a vector add) for a GPU, ahead of time, with no GPU.

cuTile's ``export_kernel`` runs the whole toolchain (cuda.tile -> Tile IR bytecode -> tileiras ->
libNVVM -> ptxas) without touching a GPU: here it shows whether the installed toolchain compiles
the kernels for a GPU generation, and on the GPU machine it separates a compile failure from a
launch failure. With ``--bytecode-dir`` it also writes each kernel's Tile IR bytecode, for
running ``tileiras`` on by hand.

    PYTHONPATH=python python bench/cutile_compile.py --arch sm_90 [--bytecode-dir DIR]

Prints one line per kernel; exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cuda.tile as ct
import torch
from cuda.tile.compilation import (
    ArrayConstraint,
    CallingConvention,
    KernelSignature,
    export_kernel,
)

from torchgraft.grafts.rms_norm import cutile_kernels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@ct.kernel
def vector_add(a, b, c, tile: ct.Constant[int]):
    block = ct.bid(0)
    ct.store(c, (block,), ct.load(a, (block,), (tile,)) + ct.load(b, (block,), (tile,)))


def _vector_add(arch: str, output_format: str) -> dict[str, bytes]:
    array = ArrayConstraint(
        ct.float32,
        1,
        index_dtype=ct.int32,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
    )
    signature = KernelSignature([array, array, array, 1024], CallingConvention.cutile_python_v1())
    out = io.BytesIO()
    export_kernel(vector_add, [signature], out, gpu_code=arch, output_format=output_format)
    return {"vector_add": out.getvalue()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--hidden", default="1000,4096,16384")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--bytecode-dir", type=Path, default=None)
    args = parser.parse_args()
    jobs: list[tuple[str, Callable[[str], dict[str, bytes]]]] = [
        ("fp32", lambda fmt: _vector_add(args.arch, fmt))
    ]
    for hidden in (int(h) for h in args.hidden.split(",")):
        for name in args.dtypes.split(","):
            jobs.append(
                (
                    f"{name} hidden={hidden}",
                    lambda fmt, h=hidden, d=DTYPES[name]: cutile_kernels.compile_ahead(
                        args.arch, h, d, fmt
                    ),
                )
            )
    failed = 0
    for label, compile_job in jobs:
        start = time.perf_counter()
        try:
            cubins = compile_job("cubin")
            seconds = time.perf_counter() - start
            for kernel, cubin in cubins.items():
                print(f"ok      {kernel} {label}: {len(cubin)} B cubin for {args.arch}")
            print(f"        ({seconds:.1f} s)")
            if args.bytecode_dir is not None:
                args.bytecode_dir.mkdir(parents=True, exist_ok=True)
                for kernel, code in compile_job("tileir_bytecode").items():
                    stem = f"{kernel}_{label}".replace(" ", "_").replace("=", "")
                    (args.bytecode_dir / f"{stem}.tilebc").write_bytes(code)
        except Exception as error:  # report every kernel, then fail
            failed += 1
            text = str(error).strip().replace("\n", " | ")
            print(f"FAILED  {label}: {type(error).__name__}: {text}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
