"""The host's cost of one ``torch._grouped_mm`` call, at a tiny shape (microseconds of GPU work,
so the wall time of calls back to back is the host's): ATen's kernel, the call through
``torchgraft.enable()``'s graft (router, cond, impl, quack), and the graft's kernel module
alone (``quack_kernels.grouped_mm``). Median of three rounds of 300 calls each.

    PYTHONPATH=python python bench/grouped_mm_host_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import torchgraft
from torchgraft.grafts.grouped_mm.quack_impl import QUACK

DEVICE = "cuda"


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Microseconds per call of ``calls`` calls issued back to back (after 20 untimed)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/grouped_mm_host_cost.py needs a CUDA GPU")
    rows = torch.randn(512, 128, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(8, 64, 128, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn(512, 64, device=DEVICE, dtype=torch.bfloat16)
    offs = torch.arange(1, 9, device=DEVICE, dtype=torch.int32) * 64
    kernels = QUACK.get()
    if kernels is None:
        raise SystemExit(f"quack could not be imported: {QUACK.error}")
    gemms = {
        "forward": (rows, weight.transpose(-2, -1)),
        "grad_weight": (grad.t(), rows),
    }
    for name, (a, b) in gemms.items():
        times: dict[str, list[float]] = {"aten": [], "graft": [], "quack_kernels": []}
        for _ in range(3):
            times["aten"].append(host_us(lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs)))
            with torchgraft.enabled():
                times["graft"].append(host_us(lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs)))
            times["quack_kernels"].append(host_us(lambda a=a, b=b: kernels.grouped_mm(a, b, offs)))
        medians = {route: round(statistics.median(t), 1) for route, t in times.items()}
        print(f"{name}: {medians} us of host per call ({torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
