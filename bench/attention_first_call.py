"""FlashAttention-4's first-call time (CuteDSL compiles its kernels then) and its steady time,
through ``F.scaled_dot_product_attention`` with torchgraft enabled, beside SDPA's own cuDNN
kernels (torchgraft disabled), at the attention shapes of ``torchgraft bench model``.

    python3 bench/attention_first_call.py bench/results/attention_first_call_cuda-<gpu>.json

The inputs are contiguous ``(B, H, S, D)`` tensors with as many key/value heads as query heads,
not the transposed ``(B, S, H, D)`` views with grouped heads a model passes: the steady times
here are not the model's (the yardstick's profile is); the first-call times are what a user waits.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torchgraft

SHAPES = {"1b": (2, 32, 4096, 64), "small": (4, 16, 2048, 128)}
"""(batch, heads, tokens, head dim) of the yardstick's sizes."""


def _seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(shape: tuple[int, int, int, int]) -> dict[str, object]:
    """First, second and median-of-10 fwd+bwd times with cuDNN and with torchgraft enabled."""
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)  # a dense gradient, as a model's backward gives

    row: dict[str, object] = {}
    for label, on in (("cudnn", False), ("torchgraft", True)):
        torchgraft.enable() if on else torchgraft.disable()
        row[f"{label}_first_s"] = _seconds(step)
        row[f"{label}_second_s"] = _seconds(step)
        row[f"{label}_median_ms"] = sorted(_seconds(step) * 1e3 for _ in range(10))[5]
    row["calls"] = {k: v for k, v in torchgraft.stats().items() if "attention" in k}
    torchgraft.disable()
    return row


def main() -> None:
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {name: list(shape) for name, shape in SHAPES.items()},
    }
    for name, shape in SHAPES.items():
        out[name] = measure(shape)
        print(name, json.dumps(out[name], default=str))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
