"""The MoE token permutation's kernels on CUDA against their memory floor and torch's ops, at
the MoE yardstick's shapes (bf16 rows, routing weights of the rows' dtype as Qwen3-MoE and
OLMoE pass them).

For each op, device time per call (one call captured in a CUDA graph, its replays timed by
``torchgraft.bench.timing.measure``; median of the rounds), for torchgraft's kernel and for the
same result in torch's ops (``reference.py``'s expressions), beside the floor: the bytes the
op must move (every output written once, every input read once) at the copy bandwidth measured
in the same run (1 GiB, the faster of ``copy_`` and an elementwise ``neg``: ``copy_`` is a
memcpy, measured at 2.77 TB/s on the H200, well below what kernels reach). Outputs are checked
against the torch ops before timing.

    PYTHONPATH=python python bench/moe_permute_cuda.py --out $OUT/moe_permute
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchgraft import functional as tgf
from torchgraft.bench import timing
from torchgraft.bench.results import write_rows
from torchgraft.ops.moe_permute.reference import moe_permute_reference, moe_unpermute_reference

OPS = torch.ops.torchgraft
DEVICE = torch.device("cuda")
# (name, tokens, top_k, experts, hidden)
SHAPES = [
    ("qwen3moe small", 8192, 8, 64, 2048),
    ("mixtral small", 8192, 2, 8, 4096),
]


def device_ms(fn: Callable[[], object], capture: bool = True) -> float:
    """Device time of one call in ms (``torchgraft.bench.timing.measure``'s median): captured
    in a CUDA graph and replayed, or (``capture=False``, for autograd, which is not captured)
    eager calls, device-bound for ops this size (the host queues them faster than the GPU
    runs them)."""
    return timing.measure(timing.graphed(fn, DEVICE) if capture else fn, DEVICE).median_ms


def copy_tb_per_s() -> float:
    """Device copy bandwidth (bytes read + written per second, in TB/s) over 1 GiB: the faster
    of ``copy_`` (a device-to-device memcpy) and an elementwise pass (``neg``)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = min(device_ms(fn) for fn in (lambda: dst.copy_(src), lambda: torch.neg(src, out=dst)))
    return 2 * src.numel() * 2 / (best * 1e-3) / 1e12


def cases(tokens: int, top_k: int, experts: int, hidden: int) -> dict[str, tuple]:
    """Per op: (torchgraft call, torch-ops call, bytes it must move). The torch ops' backward
    runs autograd, which is timed eagerly (not captured)."""
    pairs = tokens * top_k
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    perm, inv_perm, _, valid = tgf.moe_sort(ids, experts)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(pairs, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, device="cuda").to(torch.bfloat16)
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    rows, row = pairs * hidden * 2, tokens * hidden * 2

    def unpermute_backward_torch() -> tuple[torch.Tensor, ...]:
        y_ = y.detach().requires_grad_()
        w_ = w.detach().requires_grad_()
        out = moe_unpermute_reference(y_, inv_perm, valid, w_, top_k)
        return torch.autograd.grad(out, (y_, w_), grad)

    return {
        "moe_permute": (
            lambda: OPS.moe_permute(x, perm, valid, top_k),
            lambda: moe_permute_reference(x, perm, valid, top_k),
            rows + row,
        ),
        "moe_unpermute (weighted)": (
            lambda: OPS.moe_unpermute(y, inv_perm, valid, w, top_k),
            lambda: moe_unpermute_reference(y, inv_perm, valid, w, top_k),
            rows + row,
        ),
        "moe_unpermute_backward (weighted)": (
            lambda: OPS.moe_unpermute_backward(grad, y, perm, inv_perm, valid, w, top_k),
            unpermute_backward_torch,
            2 * rows + row,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_tb_per_s()
    rows = []
    for name, tokens, top_k, experts, hidden in SHAPES:
        for op, (ours, theirs, nbytes) in cases(tokens, top_k, experts, hidden).items():
            got, want = ours(), theirs()
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            for g, r in zip(got, want, strict=True):
                err = float((g.double() - r.double()).norm() / r.double().norm())
                assert err < 1e-2, f"{name} {op}: relative error {err}"
            times = {"torchgraft": [], "torch ops": []}
            for _ in range(args.rounds):
                times["torchgraft"].append(device_ms(ours))
                times["torch ops"].append(device_ms(theirs, capture="backward" not in op))
            row = {
                "shape": name,
                "op": op,
                "bytes": nbytes,
                "floor_ms": nbytes / (bandwidth * 1e12) * 1e3,
                "torchgraft_ms": statistics.median(times["torchgraft"]),
                "torch_ops_ms": statistics.median(times["torch ops"]),
            }
            row["of_floor"] = row["torchgraft_ms"] / row["floor_ms"]
            row["vs_torch_ops"] = row["torch_ops_ms"] / row["torchgraft_ms"]
            rows.append(row)
            print(row, flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_tb_per_s": bandwidth,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    lines = [
        f"**MoE permutation kernels on {meta['device']}** (torch {meta['torch']}, "
        f"{meta['date']}; bf16; copy {bandwidth:.2f} TB/s; medians of {args.rounds} rounds; "
        "`bench/moe_permute_cuda.py`)",
        "",
        "| shape | op | floor ms | torchgraft ms (x floor) | torch ops ms (x torchgraft) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['op']} | {r['floor_ms']:.3f} | {r['torchgraft_ms']:.3f} "
            f"({r['of_floor']:.2f}x) | {r['torch_ops_ms']:.3f} ({r['vs_torch_ops']:.2f}x) |"
        )
    write_rows(args.out, "moe_permute_cuda", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
