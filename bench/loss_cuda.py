"""Cross-entropy and fused linear cross-entropy on one CUDA GPU: checked, then timed.

Run from the repository root on the GPU machine (about 3 minutes on an H100, ~30 GB of GPU
memory at the peak, the eager fused-linear baseline):

    PYTHONPATH=python python3 bench/loss_cuda.py

1. Cross-entropy at 8192 x 128256 bf16 (targets with 1 row in 8 ignored), forward + backward
   through autograd: eager with HF's float32 upcast (``F.cross_entropy(x.float(), t)``), eager
   in bf16, torch.compile (Inductor) of the upcast version, Liger-Kernel's
   ``LigerCrossEntropyFunction`` when importable (gradient written over the logits),
   torchgraft (a new gradient buffer) and torchgraft with ``inplace_backward=True``; floors: a
   copy of the logits (2 passes) plus a row max (1 pass) = 3 passes, and a copy alone.
2. Fused linear cross-entropy, 8192 tokens, 2048 -> 128256, bf16, forward + backward (hidden
   and weight gradients): eager (``h @ W.T`` then the float32 upcast), eager bf16,
   torch.compile of the upcast version, Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction``
   when importable, torchgraft with its default chunk (1024 rows here) and with 256- and
   2048-row chunks; floor: three ``h @ W.T``-sized GEMMs as aten runs them.

Every route is first checked against the eager float32-upcast route (loss and gradients, as
relative norms), then timed with ``triton.testing.do_bench`` (medians, L2 flushed), and its
peak memory above the inputs measured in a separate call. Routes that overwrite their input
(in place) are timed on their previous call's output, which costs the same.

Writes $OUT/loss_cuda.json when OUT is set, else bench/results/loss_cuda.json.
Flags: --cpu-dry-run (tiny shapes on the CPU with a wall-clock timer, to check the script),
--skip-compile, --only ce|lce (one of the two benchmarks). The CUDA row kernel's launch shape
is swept by bench/kernel_lab/cross_entropy_sweep.py.
"""

from __future__ import annotations

import argparse
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
from torchgraft.bench.fused_common import loss_tensor, make_target  # noqa: E402
from torchgraft.bench.linear_cross_entropy import linear_cross_entropy_eager  # noqa: E402
from torchgraft.bench.timing import extra_peak_bytes  # noqa: E402

T0 = time.time()
Step = Callable[[], Any]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def rel_err(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if out is None or ref is None:
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_timer(dev: str) -> Callable[[Step, list[torch.Tensor]], float]:
    """Median milliseconds of one call (do_bench on CUDA, L2 flushed between calls)."""
    if dev == "cuda":
        import triton.testing

        def timer(fn: Step, leaves: list[torch.Tensor]) -> float:
            ms = triton.testing.do_bench(
                fn, warmup=50, rep=300, grad_to_none=leaves, return_mode="median"
            )
            return float(ms)

        return timer

    def cpu_timer(fn: Step, leaves: list[torch.Tensor]) -> float:
        samples = []
        for _ in range(3):
            for leaf in leaves:
                leaf.grad = None
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return sorted(samples)[1]

    return cpu_timer


def peak_extra_mib(fn: Step, leaves: list[torch.Tensor], dev: str) -> float | None:
    """Peak memory of one call above what was allocated before it, MiB (CUDA only; torchgraft
    bench's measure)."""
    if dev != "cuda":
        return None
    for leaf in leaves:
        leaf.grad = None
    peak = extra_peak_bytes(fn, torch.device(dev))
    for leaf in leaves:
        leaf.grad = None
    return None if peak is None else peak / 2**20


def liger() -> tuple[Any, Any] | None:
    """Liger-Kernel's CE and fused-linear-CE autograd functions, when importable."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
    except Exception as exc:  # any import failure: not available
        log(f"Liger-Kernel not available: {type(exc).__name__}: {exc}")
        return None
    return LigerCrossEntropyFunction, LigerFusedLinearCrossEntropyFunction


def run_routes(
    routes: dict[str, Step],
    leaves: list[torch.Tensor],
    check: Callable[[str], dict[str, float]],
    dev: str,
) -> dict[str, dict[str, Any]]:
    timer = make_timer(dev)
    out: dict[str, dict[str, Any]] = {}
    for name, fn in routes.items():
        try:
            errors = check(name)
            ms = timer(fn, leaves)
            mib = peak_extra_mib(fn, leaves, dev)
        except Exception as exc:  # report the route as failed, keep going
            log(f"  {name}: FAILED {type(exc).__name__}: {exc}")
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"ms": ms, "peak_extra_mib": mib, "err_vs_eager_fp32": errors}
        mem = f"{mib:9.1f} MiB" if mib is not None else ""
        log(f"  {name:28s} {ms * 1e3:10.0f} us {mem}  err {errors}")
    return out


# --- 1. cross-entropy ---------------------------------------------------------------------


def bench_cross_entropy(dev: str, n: int, v: int, compile_ok: bool, lig: Any) -> dict[str, Any]:
    log(f"cross-entropy {n} x {v} bf16, forward + backward")
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(n, v, device=dev, dtype=torch.bfloat16, generator=g)
    target = make_target(n, v, torch.device(dev), g)
    x = src.clone().requires_grad_()
    leaves = [x]

    def upcast(t: torch.Tensor) -> torch.Tensor:
        return cross_entropy_upcast(t, target)

    compiled = torch.compile(upcast) if compile_ok else None
    routes: dict[str, Step] = {
        "eager_fp32_upcast": lambda: upcast(x).backward(),
        "eager_bf16": lambda: F.cross_entropy(x, target).backward(),
    }
    if compiled is not None:
        routes["torch_compile_fp32_upcast"] = lambda: compiled(x).backward()
    if lig is not None:
        # Liger writes the gradient over its input: hand it a view (timed on its own output).
        routes["liger"] = lambda: loss_tensor(lig[0].apply(x.view_as(x), target, None)).backward()
    routes["torchgraft"] = lambda: tgf.cross_entropy(x, target).backward()
    routes["torchgraft_inplace"] = lambda: tgf.cross_entropy(
        x.view_as(x), target, inplace_backward=True
    ).backward()

    ref_x = src.clone().requires_grad_()
    ref_loss = upcast(ref_x)
    ref_loss.backward()

    def check(name: str) -> dict[str, float]:
        with torch.no_grad():
            x.copy_(src)
        x.grad = None
        if name == "eager_fp32_upcast":
            return {}
        loss = {
            "eager_bf16": lambda: F.cross_entropy(x, target),
            "torch_compile_fp32_upcast": lambda: compiled(x),
            "liger": lambda: loss_tensor(lig[0].apply(x.view_as(x), target, None)),
            "torchgraft": lambda: tgf.cross_entropy(x, target),
            "torchgraft_inplace": lambda: tgf.cross_entropy(
                x.view_as(x), target, inplace_backward=True
            ),
        }[name]()
        loss.backward()
        errors = {"loss": rel_err(loss, ref_loss), "grad": rel_err(x.grad, ref_x.grad)}
        with torch.no_grad():
            x.copy_(src)
        x.grad = None
        return errors

    results = run_routes(routes, leaves, check, dev)
    timer = make_timer(dev)
    buf = torch.empty_like(src)
    copy_ms = timer(lambda: buf.copy_(src), [])
    max_ms = timer(lambda: src.amax(dim=-1), [])
    floors = {
        "copy_2pass_ms": copy_ms,
        "rowmax_1pass_ms": max_ms,
        "three_pass_ms": copy_ms + max_ms,
    }
    log(f"  floors: copy {copy_ms * 1e3:.0f} us, row max {max_ms * 1e3:.0f} us, 3 passes "
        f"{(copy_ms + max_ms) * 1e3:.0f} us")  # fmt: skip
    return {"shape": [n, v], "dtype": "bf16", "routes": results, "floors": floors}


# --- 2. fused linear cross-entropy ----------------------------------------------------------


def bench_linear_cross_entropy(
    dev: str, n: int, h: int, v: int, compile_ok: bool, lig: Any
) -> dict[str, Any]:
    log(f"fused linear cross-entropy {n} tokens, {h} -> {v} bf16, forward + backward")
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16, generator=g)
    weight = torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g) * h**-0.5
    target = make_target(n, v, torch.device(dev), g)
    hx = hidden.clone().requires_grad_()
    wx = weight.clone().requires_grad_()
    leaves = [hx, wx]

    def upcast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_eager(a, b, target)

    compiled = torch.compile(upcast) if compile_ok else None
    losses: dict[str, Callable[[], torch.Tensor]] = {
        "eager_fp32_upcast": lambda: upcast(hx, wx),
        "eager_bf16": lambda: F.cross_entropy(hx @ wx.T, target),
    }
    if compiled is not None:
        losses["torch_compile_fp32_upcast"] = lambda: compiled(hx, wx)
    if lig is not None:
        losses["liger"] = lambda: loss_tensor(lig[1].apply(hx, wx, target))
    losses["torchgraft"] = lambda: tgf.linear_cross_entropy(hx, wx, target)
    losses["torchgraft_chunk256"] = lambda: tgf.linear_cross_entropy(hx, wx, target, chunk_size=256)
    losses["torchgraft_chunk2048"] = lambda: tgf.linear_cross_entropy(
        hx, wx, target, chunk_size=2048
    )
    routes: dict[str, Step] = {name: (lambda f=f: f().backward()) for name, f in losses.items()}

    ref = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    ref_loss = upcast(*ref)
    ref_loss.backward()

    def check(name: str) -> dict[str, float]:
        if name == "eager_fp32_upcast":
            return {}
        hx.grad = wx.grad = None
        loss = losses[name]()
        loss.backward()
        errors = {
            "loss": rel_err(loss, ref_loss),
            "d_hidden": rel_err(hx.grad, ref[0].grad),
            "d_weight": rel_err(wx.grad, ref[1].grad),
        }
        hx.grad = wx.grad = None
        return errors

    results = run_routes(routes, leaves, check, dev)
    timer = make_timer(dev)
    logits = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
    mm_ms = timer(lambda: torch.mm(hidden, weight.T, out=logits), [])
    flops = 3 * 2 * n * h * v
    floors = {"one_gemm_ms": mm_ms, "three_gemms_ms": 3 * mm_ms, "flop": flops}
    log(f"  floor: 3 GEMMs {3 * mm_ms * 1e3:.0f} us ({flops / (3 * mm_ms) / 1e9:.0f} TFLOP/s)")
    return {"tokens": n, "hidden": h, "vocab": v, "dtype": "bf16", "routes": results,
            "floors": floors}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--only", choices=["ce", "lce"], default=None)
    args = ap.parse_args()
    dry = args.cpu_dry_run
    dev = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu-dry-run)")
    lig = None if dry else liger()
    compile_ok = not args.skip_compile and not dry
    n, h, v = (64, 64, 1000) if dry else (8192, 2048, 128256)
    ce = lce = None
    if args.only in (None, "ce"):
        ce = bench_cross_entropy(dev, n, v, compile_ok, lig)
    if args.only in (None, "lce"):
        lce = bench_linear_cross_entropy(dev, 2 * n if dry else n, h, v, compile_ok, lig)
    report = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cross_entropy": ce,
        "linear_cross_entropy": lce,
        "seconds": time.time() - T0,
    }
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "loss_cuda_dry_run.json" if dry else "loss_cuda.json"
    (out_dir / name).write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main()
