"""Cross-entropy and fused linear cross-entropy on the CPU against eager PyTorch, bf16.

    PYTHONPATH=python python3 bench/loss_cpu.py

Forward + backward through autograd, medians of 5 (after one warm-up call), milliseconds:
cross-entropy at 2048 x 32000 (eager with the float32 upcast, eager bf16, torchgraft with a new
gradient buffer and with ``inplace_backward=True``) and the fused loss at 2048 tokens,
512 -> 32000 (eager upcast and bf16, torchgraft; floor: the three GEMMs as aten runs them).
Every torchgraft route is checked against the eager upcast first. Writes
$OUT/loss_cpu.json when OUT is set, else bench/results/loss_cpu.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
try:  # an installed build (e.g. the wheel on PYTHONPATH on the GPU machine)...
    import torchgraft._native  # noqa: F401
except ImportError:  # ...else this checkout, built in place (make build)
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchgraft import functional as tgf  # noqa: E402
from torchgraft.bench.cross_entropy import cross_entropy_upcast  # noqa: E402
from torchgraft.bench.fused_common import make_target  # noqa: E402
from torchgraft.bench.linear_cross_entropy import linear_cross_entropy_eager  # noqa: E402


def median_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[reps // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def cross_entropy(n: int, v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    src = torch.randn(n, v, generator=g, dtype=torch.bfloat16)
    target = make_target(n, v, torch.device("cpu"), g)
    x = src.clone().requires_grad_()

    def step(loss_fn: Callable[[torch.Tensor], torch.Tensor], view: bool = False) -> None:
        x.grad = None
        loss_fn(x.view_as(x) if view else x).backward()

    ref_x = src.clone().requires_grad_()
    ref = cross_entropy_upcast(ref_x, target)
    ref.backward()
    routes: dict[str, Callable[[], None]] = {
        "eager_fp32_upcast": lambda: step(lambda t: cross_entropy_upcast(t, target)),
        "eager_bf16": lambda: step(lambda t: F.cross_entropy(t, target)),
        "torchgraft": lambda: step(lambda t: tgf.cross_entropy(t, target)),
        # Overwrites x (timed on its own output, the same cost).
        "torchgraft_inplace": lambda: step(
            lambda t: tgf.cross_entropy(t, target, inplace_backward=True), view=True
        ),
    }
    errors = {}
    for name in ("torchgraft", "torchgraft_inplace"):
        with torch.no_grad():
            x.copy_(src)
        x.grad = None
        loss = tgf.cross_entropy(x.view_as(x), target, inplace_backward=name.endswith("inplace"))
        loss.backward()
        errors[name] = {"loss": rel_err(loss, ref), "grad": rel_err(x.grad, ref_x.grad)}
    times = {name: median_ms(fn) for name, fn in routes.items()}
    return {"shape": [n, v], "ms": times, "errors_vs_eager_fp32": errors}


def linear_cross_entropy(n: int, h: int, v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).bfloat16().requires_grad_()
    target = make_target(n, v, torch.device("cpu"), g)

    def step(loss_fn: Callable[[], torch.Tensor]) -> None:
        hidden.grad = weight.grad = None
        loss_fn().backward()

    ref = linear_cross_entropy_eager(hidden, weight, target)
    ref.backward()
    ref_grads = (hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    loss = tgf.linear_cross_entropy(hidden, weight, target)
    loss.backward()
    errors = {
        "loss": rel_err(loss, ref),
        "d_hidden": rel_err(hidden.grad, ref_grads[0]),
        "d_weight": rel_err(weight.grad, ref_grads[1]),
    }
    routes: dict[str, Callable[[], Any]] = {
        "eager_fp32_upcast": lambda: step(
            lambda: linear_cross_entropy_eager(hidden, weight, target)
        ),
        "eager_bf16": lambda: step(lambda: F.cross_entropy(hidden @ weight.T, target)),
        "torchgraft": lambda: step(lambda: tgf.linear_cross_entropy(hidden, weight, target)),
    }
    times = {name: median_ms(fn) for name, fn in routes.items()}
    logits = torch.empty(n, v, dtype=torch.bfloat16)
    with torch.no_grad():
        hd, wd = hidden.detach(), weight.detach()
        times["gemm_floor_x3"] = 3 * median_ms(lambda: torch.mm(hd, wd.T, out=logits))
    return {"tokens": n, "hidden": h, "vocab": v, "ms": times, "errors_vs_eager_fp32": errors}


def main() -> None:
    report = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cross_entropy": cross_entropy(2048, 32000),
        "linear_cross_entropy": linear_cross_entropy(2048, 512, 32000),
    }
    for key in ("cross_entropy", "linear_cross_entropy"):
        ms = report[key]["ms"]
        base = ms["eager_fp32_upcast"]
        print(key, {k: f"{v:.1f} ms ({base / v:.2f}x)" for k, v in ms.items()})
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "loss_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", out_dir / "loss_cpu.json")


if __name__ == "__main__":
    main()
