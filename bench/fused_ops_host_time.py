"""Host time per call of the fused ops' autograd paths, at inputs small enough that the host is
all that is timed.

For RMSNorm, RoPE and SwiGLU, a forward (with gradients recorded) and a forward + backward run
back to back, with one synchronisation at the end of each sample. Three routes run in one
process, in alternating rounds:
- ``functional``: ``torchgraft.functional.*``, the direct eager path
  (torchgraft.common.eager_autograd);
- ``registered``: the same op called as ``torch.ops.torchgraft.*``, through the autograd that
  ``torch.library.register_autograd`` gives it (what ``functional`` ran before);
- ``eager``: the composite of aten ops that the fused op replaces.

    python bench/fused_ops_host_time.py [--device cuda] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchgraft import functional as tgf
from torchgraft.ops.rope.reference import rope_eager

Fn = Callable[[], object]


def per_call_us(fn: Fn, calls: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def cases(device: torch.device) -> dict[str, dict[str, Fn]]:
    """Per op, per route, one call; the ``+bwd`` entries also run the backward."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=True)

    x, w = leaf(16, 256), leaf(256)
    gate, up = leaf(16, 512), leaf(16, 512)
    # Llama's layout: q and k are transposed views of (batch, seq, heads * dim) projections.
    qp, kp = leaf(1, 16, 4 * 64), leaf(1, 16, 2 * 64)
    cos = torch.randn(1, 16, 64, device=device, dtype=dt)
    sin = torch.randn(1, 16, 64, device=device, dtype=dt)
    leaves = (x, w, gate, up, qp, kp)

    def heads() -> tuple[torch.Tensor, torch.Tensor]:
        return qp.view(1, 16, 4, 64).transpose(1, 2), kp.view(1, 16, 2, 64).transpose(1, 2)

    ops: dict[str, dict[str, Callable[[], Any]]] = {
        "rms_norm": {
            "functional": lambda: (tgf.rms_norm(x, w, 1e-6),),
            "registered": lambda: (torch.ops.torchgraft.rms_norm(x, w, 1e-6, 0.0, False)[0],),
            "eager": lambda: (F.rms_norm(x, (256,), w, 1e-6),),
        },
        "rope": {
            "functional": lambda: tgf.rope(*heads(), cos, sin),
            "registered": lambda: torch.ops.torchgraft.rope(*heads(), cos, sin, 1),
            "eager": lambda: rope_eager(*heads(), cos, sin),
        },
        "swiglu": {
            "functional": lambda: (tgf.swiglu(gate, up),),
            "registered": lambda: (torch.ops.torchgraft.swiglu(gate, up),),
            "eager": lambda: (F.silu(gate) * up,),
        },
    }

    def with_backward(forward: Callable[[], Any]) -> Fn:
        def run() -> None:
            outputs = forward()
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            for t in leaves:
                t.grad = None

        return run

    return {
        f"{op}{part}": {
            route: (forward if part == " fwd" else with_backward(forward))
            for route, forward in routes.items()
        }
        for op, routes in ops.items()
        for part in (" fwd", " fwd+bwd")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=300, help="calls per sample")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    table = cases(device)
    samples: dict[str, dict[str, list[float]]] = {
        name: {route: [] for route in routes} for name, routes in table.items()
    }
    for routes in table.values():
        for fn in routes.values():
            per_call_us(fn, 50, device)  # warm-up
    for _ in range(args.rounds):
        for name, routes in table.items():
            for route, fn in routes.items():
                samples[name][route].append(per_call_us(fn, args.calls, device))
    results: dict[str, Any] = {}
    for name, by_route in samples.items():
        medians = {route: statistics.median(s) for route, s in by_route.items()}
        results[name] = {
            "median_us": medians,
            "registered_over_functional": medians["registered"] / medians["functional"],
        }
        print(
            f"{name:18s} "
            + "  ".join(f"{route} {us:7.1f} us" for route, us in medians.items())
            + f"   registered / functional {results[name]['registered_over_functional']:.2f}x"
        )
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "method": f"median over {args.rounds} alternating rounds of {args.calls} back-to-back "
        "calls, one synchronisation per sample (perf_counter)",
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
