"""What adoption costs or saves per RMSNorm layer: one transformers LlamaRMSNorm, training step.

Each route runs `--steps` forward+backward steps of the layer back to back (input and weight
require grad) with one synchronisation, in alternating rounds, median over rounds
(`steps_ms` of bench/rms_norm_train_step.py). Routes:

- own: the model's forward (fp32 upcast by hand), stock PyTorch;
- adopted: `torchgraft.adopt` + enable: `torchgraft::rms_norm` with the model's rounding (one
  kernel each way; before it existed, `weight * F.rms_norm(x, [H], None, eps)`);
- adopted, fuse_weight: `adopt(..., fuse_weight=True)` + enable: the same where
  `torchgraft.functional.rms_norm` exists (else `F.rms_norm(x, [H], weight, eps)`);
- hand-routed: the forward replaced by `F.rms_norm(x, [H], weight, eps)` by hand + enable.

    python bench/adopt_rms_norm_layer.py [--shapes 8x2048x2048 ...] [--out FILE]

Needs a CUDA GPU and transformers. Prints a markdown table; writes JSON to --out if given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import torchgraft
from rms_norm_train_step import steps_ms
from torchgraft.bench import harness

ROUTES = ("own", "adopted", "adopted, fuse_weight", "hand-routed")


def _layer(route: str, weight: torch.Tensor) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layer = LlamaRMSNorm(weight.shape[0], eps=1e-6).to(weight.device, weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    if route == "adopted":
        torchgraft.adopt(layer, via="forward")
    elif route == "adopted, fuse_weight":
        torchgraft.adopt(layer, via="forward", fuse_weight=True)
    elif route == "hand-routed":

        def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)

        layer.forward = types.MethodType(forward, layer)
    return layer


def run_shape(shape: tuple[int, ...], dtype: torch.dtype, steps: int, rounds: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    grad = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], device="cuda", generator=gen)).to(dtype)
    layers = {route: _layer(route, weight) for route in ROUTES}

    def step(layer: torch.nn.Module) -> None:
        layer(x).backward(grad)

    ref = layers["own"](x).float()
    result: dict = {"shape": "x".join(map(str, shape)), "routes": {}}
    for route, layer in layers.items():
        with torchgraft.enabled() if route != "own" else _stock():
            out = layer(x).float()
        err = float((out - ref).norm() / ref.norm())
        result["routes"][route] = {"rel_err_vs_own": err, "round_ms": []}
    for _ in range(rounds):
        for route, layer in layers.items():
            with torchgraft.enabled() if route != "own" else _stock():
                steps_ms(lambda layer=layer: step(layer), 3)
                ms = steps_ms(lambda layer=layer: step(layer), steps)
            result["routes"][route]["round_ms"].append(ms)
    for entry in result["routes"].values():
        entry["median_ms"] = statistics.median(entry["round_ms"])
    return result


class _stock:
    def __enter__(self) -> None:
        torchgraft.disable()

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x2048x2048", "8x2048x4096"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("adopt_rms_norm_layer: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    results = [
        run_shape(tuple(int(s) for s in label.split("x")), dtype, args.steps, args.rounds)
        for label in args.shapes
    ]
    print(
        f"**LlamaRMSNorm training step, {args.dtype}, {torch.cuda.get_device_name()}: "
        "median ms per step (rel. error of the output vs own)**\n"
    )
    print("| shape | " + " | ".join(ROUTES) + " |")
    print("|" + "---|" * (len(ROUTES) + 1))
    for r in results:
        cells = [
            f"{r['routes'][n]['median_ms']:.4f} ({r['routes'][n]['rel_err_vs_own']:.0e})"
            for n in ROUTES
        ]
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    if args.out:
        report = {
            "benchmark": "LlamaRMSNorm training step per route (adopt, fuse_weight, by hand)",
            "command": "python " + " ".join(sys.argv),
            "device": harness.describe_device(torch.device("cuda")),
            "versions": harness.versions(),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
