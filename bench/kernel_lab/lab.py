"""Kernel lab: launch the entry points of one of crates/graft-cuda/src/ops/<op>/<op>.cu (or a
variant of it) with launch shapes of your choice, on the GPU machine, without building a wheel.

The source is compiled there with nvcc to a cubin, loaded through the CUDA driver API (ctypes)
into the context torch uses, and launched on torch's current stream; times are medians of CUDA
events around back-to-back launches. Used to choose launch shapes (the sweeps beside this file);
the library's own launches live in crates/graft-cuda/src.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parents[2] / "crates" / "graft-cuda" / "src" / "ops"
_FUNC_ATTR_NUM_REGS = 4
_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: CUDA driver error {code}")


class Module:
    """A .cu file compiled for this GPU and loaded; its kernels by name."""

    def __init__(self, source: str | Path, extra_flags: tuple[str, ...] = ()) -> None:
        major, minor = torch.cuda.get_device_capability()
        out = Path("/tmp") / f"{Path(source).name}.sm{major}{minor}.cubin"
        nvcc = os.environ.get("NVCC", "nvcc")
        # common.cuh is in KERNELS, each op's <op>.cu (included by variants) in KERNELS/<op>.
        includes = [KERNELS, *sorted(d for d in KERNELS.iterdir() if d.is_dir())]
        cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-arch=sm_{major}{minor}"]
        cmd += [arg for d in includes for arg in ("-I", d)]
        subprocess.run([*map(str, cmd), *extra_flags, str(source), "-o", str(out)], check=True)
        torch.empty(1, device="cuda")  # torch's primary context, current on this thread
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._module = ctypes.c_void_p()
        _check(self._cuda.cuModuleLoad(ctypes.byref(self._module), str(out).encode()), "load")
        self._functions: dict[str, ctypes.c_void_p] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        if name not in self._functions:
            f = ctypes.c_void_p()
            _check(
                self._cuda.cuModuleGetFunction(ctypes.byref(f), self._module, name.encode()), name
            )
            self._functions[name] = f
        return self._functions[name]

    def registers(self, name: str) -> int:
        n = ctypes.c_int()
        code = self._cuda.cuFuncGetAttribute(
            ctypes.byref(n), _FUNC_ATTR_NUM_REGS, self.function(name)
        )
        _check(code, f"{name} registers")
        return n.value

    def allow_shared_memory(self, name: str, nbytes: int) -> None:
        attr = _FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(self._cuda.cuFuncSetAttribute(self.function(name), attr, nbytes), name)

    def launch(
        self, name: str, grid: int, block: int, params: ctypes.Structure, smem: int = 0
    ) -> None:
        """Launches ``name`` with one by-value struct parameter (the kernels' params)."""
        args = (ctypes.c_void_p * 1)(ctypes.c_void_p(ctypes.addressof(params)))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        code = self._cuda.cuLaunchKernel(
            self.function(name), grid, 1, 1, block, 1, 1, smem, stream, args, None
        )
        _check(code, f"launch {name}")


def median_ms(call: Callable[[], object], samples: int = 30, calls: int = 10) -> float:
    """Median time of one call over ``samples`` samples of ``calls`` back-to-back calls."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
