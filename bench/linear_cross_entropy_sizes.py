"""Sizes of the fused linear cross-entropy's two-pass scheme on CUDA: forward + backward time
and extra peak memory for each ``TORCHGRAFT_LCE_SCHEME`` given (``rows``, ``two-pass`` or
``R,Vb[,P]``), Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` measured in the same process,
rounds alternating. bf16, 2048 -> 128256 (Llama 3.2 1B's head).

    python bench/linear_cross_entropy_sizes.py [--tokens 8192] [--rounds 2] [SCHEME ...]

Writes JSON to ``$OUT`` (or the working directory): linear_cross_entropy_sizes.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton.testing
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

import torchgraft.functional as tgf
from torchgraft.bench.timing import extra_peak_bytes

DEFAULT_SCHEMES = ["rows", "two-pass", "1024,8192,1024", "2048,8192,2048", "2048,8192,1024"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("schemes", nargs="*", default=DEFAULT_SCHEMES)
    args = parser.parse_args()
    n, h, v = args.tokens, 2048, 128256
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    liger_loss = LigerFusedLinearCrossEntropyLoss()

    def torchgraft_step() -> None:
        tgf.linear_cross_entropy(hidden, weight, target).backward()

    def liger_step() -> None:
        liger_loss(weight, hidden, target).backward()  # Liger takes the weight first

    runs = []
    for rnd in range(args.rounds):
        for name in ["liger", *args.schemes]:
            if name != "liger":
                os.environ["TORCHGRAFT_LCE_SCHEME"] = name
            step = liger_step if name == "liger" else torchgraft_step
            hidden.grad = weight.grad = None
            peak = extra_peak_bytes(step, torch.device("cuda"))
            hidden.grad = weight.grad = None
            ms = triton.testing.do_bench(
                step, warmup=30, rep=400, grad_to_none=[hidden, weight], return_mode="median"
            )
            record = {"round": rnd, "scheme": name, "ms": ms, "extra_mib": (peak or 0) / 2**20}
            runs.append(record)
            print(json.dumps(record), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [n, h, v],
        "runs": runs,
    }
    out = Path(os.environ.get("OUT", ".")) / "linear_cross_entropy_sizes.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
