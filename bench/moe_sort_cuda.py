"""The MoE routing's sort by expert on CUDA: ``torchgraft.functional.moe_sort`` (two CUDA
launches) against the same result from torch's ops (``moe_sort_reference``: a stable sort, a
search and an inverse scatter, about a dozen kernels), at the routing shapes of the MoE
yardstick and beyond.

For each shape and route, in alternating rounds:

  device_us  the kernels alone: one call captured in a CUDA graph, its replays timed
             (``torchgraft.bench.timing.measure``: the median of many)
  wall_us    what an eager step pays: 200 calls back to back, then a synchronisation, per call
             (the larger of the host's issue time and the device time)

Medians over the rounds; the ratios are the torch ops' time over torchgraft's, same run.
Both routes' outputs are checked equal before timing.

    PYTHONPATH=python python bench/moe_sort_cuda.py --out $OUT/moe_sort
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
from torchgraft.ops.moe_permute.reference import moe_sort_reference

# (name, tokens, top_k, experts)
SHAPES = [
    ("mixtral small (2x4096 tokens, top-2 of 8)", 8192, 2, 8),
    ("qwen3moe/olmoe small (2x4096 tokens, top-8 of 64)", 8192, 8, 64),
    ("top-8 of 256 (DeepSeek-V3's count)", 8192, 8, 256),
    ("8x4096 tokens, top-8 of 128", 32768, 8, 128),
]
DEVICE = torch.device("cuda")
ROUTES: dict[str, Callable[[torch.Tensor, int], object]] = {
    "torch ops": moe_sort_reference,
    "torchgraft": tgf.moe_sort,
}


def device_us(fn: Callable[[], object]) -> float:
    """Device time of one call: ``fn`` captured in a CUDA graph, the replays timed."""
    return timing.measure(timing.graphed(fn, DEVICE), DEVICE).median_ms * 1e3


def wall_us(fn: Callable[[], object]) -> float:
    """Per-call wall time of 200 eager calls back to back, synchronised before and after."""
    return timing.back_to_back_ms(fn, 200, DEVICE) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, tokens, top_k, experts in SHAPES:
        ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
        outs = [route(ids, experts) for route in ROUTES.values()]
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), f"{name}: the routes differ"  # type: ignore[arg-type]
        times: dict[str, dict[str, list[float]]] = {r: {"device": [], "wall": []} for r in ROUTES}
        for _ in range(args.rounds):
            for route_name, route in ROUTES.items():
                call = lambda route=route, ids=ids, experts=experts: route(ids, experts)  # noqa: E731
                times[route_name]["device"].append(device_us(call))
                times[route_name]["wall"].append(wall_us(call))
        row = {"shape": name, "tokens": tokens, "top_k": top_k, "experts": experts}
        for route_name in ROUTES:
            for kind in ("device", "wall"):
                row[f"{route_name} {kind}_us"] = statistics.median(times[route_name][kind])
        for kind in ("device", "wall"):
            row[f"{kind} ratio"] = row[f"torch ops {kind}_us"] / row[f"torchgraft {kind}_us"]
        rows.append(row)
        print(row, flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    lines = [
        f"**moe_sort on {meta['device']}** (torch {meta['torch']}, {meta['date']}, medians of "
        f"{meta['rounds']} rounds; `bench/moe_sort_cuda.py`)",
        "",
        "| routing | torch ops: device / wall us | torchgraft: device / wall us "
        "| ratio device / wall |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['torch ops device_us']:.1f} / {r['torch ops wall_us']:.1f} | "
            f"{r['torchgraft device_us']:.1f} / {r['torchgraft wall_us']:.1f} | "
            f"{r['device ratio']:.2f}x / {r['wall ratio']:.2f}x |"
        )
    stem = write_rows(args.out, "moe_sort_cuda", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, kind in zip(axes, ("device", "wall"), strict=True):
        x = range(len(rows))
        for i, route in enumerate(ROUTES):
            ax.bar([v + 0.4 * i for v in x], [r[f"{route} {kind}_us"] for r in rows], 0.4,
                   label=route)  # fmt: skip
        ax.set_xticks(
            [v + 0.2 for v in x], [f"{r['tokens']}x{r['top_k']}/{r['experts']}" for r in rows]
        )
        ax.set_ylabel(f"{kind} us per call")
        ax.legend()
    fig.suptitle(f"moe_sort, {meta['device']}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
