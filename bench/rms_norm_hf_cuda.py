"""RMSNorm as transformers models write it, on the GPU: one layer, forward and forward+backward.

One Llama-shaped layer (8 x 2048 tokens x 2048 hidden, bfloat16 by default), in the two forms
models write (llama: ``weight * xhat.to(dtype)``; gemma: ``(xhat * (1 + weight.float()))
.to(dtype)``), through each route:

- model: the model's own expression, op by op (stock PyTorch);
- two-kernel: what ``torchgraft.adopt`` routed to before ``torchgraft::rms_norm`` (and still
  does without it), under ``torchgraft.enabled()``: llama ``weight * F.rms_norm(x, [H], None)``,
  gemma ``F.rms_norm(x.float(), [H], 1 + weight.float()).to(dtype)``;
- torchgraft: ``torchgraft.functional.rms_norm`` (one kernel forward, one backward);
- liger: Liger-Kernel's ``LigerRMSNorm`` function with the matching ``casting_mode`` and offset
  (``in_place=False``: dx in a tensor of its own, as the others), when liger_kernel imports.

Times are medians of ``torchgraft.bench.timing.measure`` (triton's do_bench, L2 flushed before
every call); fwd+bwd is ``torch.autograd.grad`` of x and weight (no accumulation into .grad).
Each route's CUDA kernels per call are counted with torch.profiler, and its output and
gradients are compared with the model's (relative error). Runs in well under two minutes.

    python bench/rms_norm_hf_cuda.py [--tokens 16384] [--hidden 2048] [--dtype bfloat16]
        [--out bench/results/rms_norm_hf_cuda.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import functional as tgf
from torchgraft.bench import harness
from torchgraft.bench.timing import measure, method_name

EPS = 1e-6
Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (form, offset, cast_before_weight, liger casting_mode)
FORMS = (("llama", 0.0, True, "llama"), ("gemma", 1.0, False, "gemma"))


def _model(offset: float, cast: bool) -> Norm:
    def llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return w * h.to(x.dtype)

    def gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return (h * (offset + w.float())).to(x.dtype)

    return llama if cast else gemma


def _two_kernel(offset: float, cast: bool) -> Norm:
    def llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * F.rms_norm(x, (x.shape[-1],), None, EPS)

    def gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), offset + w.float(), EPS).to(x.dtype)

    return llama if cast else gemma


def _torchgraft(offset: float, cast: bool) -> Norm:
    return lambda x, w: tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)


def _liger(offset: float, mode: str) -> Norm | str:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as e:  # not installed, or fails to import here
        return f"liger_kernel does not import: {type(e).__name__}: {e}"
    # LigerRMSNorm's function: (X, W, eps, offset, casting_mode, in_place).
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, offset, mode, False)


def _kernels(fn: Callable[[], object], device: torch.device) -> int | None:
    """CUDA kernels one call of ``fn`` launches (None off the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def run_form(
    form: tuple[str, float, bool, str], tokens: int, hidden: int, dtype: torch.dtype, device: str
) -> dict:
    name, offset, cast, mode = form
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(tokens, hidden, device=device, generator=gen) * 2).to(dtype)
    w = (torch.randn(hidden, device=device, generator=gen) * 0.2 + 1 - offset).to(dtype)
    dy = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    routes: dict[str, Norm | str] = {
        "model": _model(offset, cast),
        "two-kernel": _two_kernel(offset, cast),
        "torchgraft": _torchgraft(offset, cast),
        "liger": _liger(offset, mode) if x.is_cuda else "needs CUDA",
    }
    ref_y = routes["model"](x, w)  # type: ignore[operator]
    ref_dx, ref_dw = torch.autograd.grad(ref_y, (x, w), dy)
    out: dict = {"form": name, "routes": {}}
    for route, fn in routes.items():
        if isinstance(fn, str):
            out["routes"][route] = {"skipped": fn}
            continue
        grafted = route != "model"
        with torchgraft.enabled() if grafted else _disabled():

            def fwd(fn: Norm = fn) -> torch.Tensor:
                with torch.no_grad():
                    return fn(x, w)

            def fwd_bwd(fn: Norm = fn) -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(fn(x, w), (x, w), dy)

            y = fn(x, w)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            out["routes"][route] = {
                "fwd_ms": measure(fwd, x.device).median_ms,
                "fwd_bwd_ms": measure(fwd_bwd, x.device).median_ms,
                "fwd_kernels": _kernels(fwd, x.device),
                "fwd_bwd_kernels": _kernels(fwd_bwd, x.device),
                "rel_err_y": _rel(y, ref_y),
                "rel_err_dx": _rel(dx, ref_dx),
                "rel_err_dw": _rel(dw, ref_dw),
                "same_bits_y": float((y == ref_y).float().mean()),
            }
    return out


class _disabled:
    def __enter__(self) -> None:
        torchgraft.disable()

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("rms_norm_hf_cuda: needs a CUDA GPU (or --device cpu for a smoke run)")
    dtype = getattr(torch, args.dtype)
    results = [run_form(f, args.tokens, args.hidden, dtype, args.device) for f in FORMS]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"**RMSNorm layer {args.tokens} x {args.hidden} {args.dtype}, {name}: "
        "median us (CUDA kernels per call)**\n"
    )
    print("| form | route | fwd us | fwd+bwd us | rel err y / dx / dw vs model | y bits = model |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for route, m in r["routes"].items():
            if "skipped" in m:
                print(f"| {r['form']} | {route} | skipped: {m['skipped'][:60]} | | | |")
                continue
            print(
                f"| {r['form']} | {route} | {1e3 * m['fwd_ms']:.1f} ({m['fwd_kernels']}) | "
                f"{1e3 * m['fwd_bwd_ms']:.1f} ({m['fwd_bwd_kernels']}) | "
                f"{m['rel_err_y']:.1e} / {m['rel_err_dx']:.1e} / {m['rel_err_dw']:.1e} | "
                f"{100 * m['same_bits_y']:.2f}% |"
            )
    if args.out:
        report = {
            "benchmark": "RMSNorm layer as models write it: model, two-kernel, torchgraft, liger",
            "command": "python " + " ".join(sys.argv),
            "timing": method_name(device),
            "device": harness.describe_device(device),
            "versions": harness.versions(),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
