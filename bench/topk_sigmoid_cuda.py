"""The sigmoid group-limited MoE routing (``torchgraft::topk_sigmoid``) on CUDA against the
routers' own expression in torch's ops (transformers' ``DeepseekV3TopkRouter``: sigmoid, the
bias, the group scores by ``topk(2)``, the group mask, ``topk``, ``gather``, the renormalization
and the scale) and against the op's memory floor, at DeepSeek-V3's, GLM-4.5's and the
yardstick's ``glm4moe`` shapes (8192 tokens, float32 logits as the routers compute them).

Device time per call, forward alone (one call captured in a CUDA graph, its replays timed by
``torchgraft.bench.timing.measure``) and forward + backward (eager autograd calls, device-bound
at these sizes); medians of the rounds. The floor is the forward's bytes (logits read, weights
and indices written) at the copy bandwidth of the same run. Outputs are checked against the
torch ops before timing.

    PYTHONPATH=python python bench/topk_sigmoid_cuda.py --out $OUT/topk_sigmoid
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from torchgraft import functional as tgf
from torchgraft.bench import timing
from torchgraft.bench.results import write_rows

DEVICE = torch.device("cuda")
# (name, tokens, experts, k, groups, topk_groups)
SHAPES = [
    ("DeepSeek-V3 (256 experts, 8 groups, 4 kept, top-8)", 8192, 256, 8, 8, 4),
    ("GLM-4.5 (160 experts, one group, top-8)", 8192, 160, 8, 1, 1),
    ("yardstick glm4moe small (64 experts, 8 groups, 4 kept, top-8)", 8192, 64, 8, 8, 4),
]
SCALE = 2.5


def device_ms(fn: Callable[[], object], capture: bool = True) -> float:
    """Device time of one call in ms (``timing.measure``'s median), captured in a CUDA graph
    and replayed, or eager calls (``capture=False``, for autograd)."""
    return timing.measure(timing.graphed(fn, DEVICE) if capture else fn, DEVICE).median_ms


def copy_tb_per_s() -> float:
    """Device copy bandwidth (bytes read + written per second, in TB/s) over 1 GiB: the faster
    of ``copy_`` and an elementwise pass (``neg``)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = min(device_ms(fn) for fn in (lambda: dst.copy_(src), lambda: torch.neg(src, out=dst)))
    return 2 * src.numel() * 2 / (best * 1e-3) / 1e12


def routers_expression(
    logits: Tensor, bias: Tensor, k: int, groups: int, topk_groups: int
) -> tuple[Tensor, Tensor]:
    """What transformers' DeepSeek-V3 / GLM-4-MoE routers run after their linear layer."""
    scores = logits.sigmoid()
    choice = scores + bias
    experts = logits.shape[-1]
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * SCALE, indices


def measure(shape: tuple, rounds: int, bandwidth: float) -> dict[str, object]:
    """One shape's row: the choice checked against the routers' expression, then timed."""
    name, tokens, experts, k, groups, topk_groups = shape
    logits = torch.randn(tokens, experts, device=DEVICE)
    bias = torch.randn(experts, device=DEVICE) * 0.1
    grad = torch.randn(tokens, k, device=DEVICE)
    leaf = logits.clone().requires_grad_()

    def ours(x: Tensor = logits) -> tuple[Tensor, Tensor]:
        return tgf.topk_sigmoid(
            x, k, bias=bias, groups=groups, topk_groups=topk_groups, renormalize=True, scale=SCALE
        )

    def theirs(x: Tensor = logits) -> tuple[Tensor, Tensor]:
        return routers_expression(x, bias, k, groups, topk_groups)

    (w, i), (w_ref, i_ref) = ours(), theirs()
    # torch.topk(sorted=False) leaves the order open: compare each token's choice as a set.
    got, want = i.sort(dim=-1), i_ref.sort(dim=-1)
    same = (got.values == want.values).all(dim=-1)
    agree = float(same.float().mean())
    assert agree > 0.999, f"{name}: the choice differs in {1 - agree:.2%} of the tokens"
    ws, ws_ref = w.gather(-1, got.indices)[same], w_ref.gather(-1, want.indices)[same]
    err = float((ws - ws_ref).norm() / ws_ref.norm())
    assert err < 1e-5, f"{name}: weights' relative error {err}"

    calls = {
        "torchgraft_forward_ms": (ours, True),
        "torch_ops_forward_ms": (theirs, True),
        "torchgraft_forward_backward_ms": (lambda: ours(leaf)[0].backward(grad), False),
        "torch_ops_forward_backward_ms": (lambda: theirs(leaf)[0].backward(grad), False),
    }
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, (fn, capture) in calls.items():
            times[key].append(device_ms(fn, capture))
    nbytes = tokens * experts * 4 + tokens * k * (4 + 8)
    row: dict[str, object] = {
        "shape": name,
        "tokens": tokens,
        "experts": experts,
        "k": k,
        "groups": groups,
        "topk_groups": topk_groups,
        "choice_agreement": agree,
        "floor_ms": nbytes / (bandwidth * 1e12) * 1e3,
    }
    row |= {key: statistics.median(v) for key, v in times.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_tb_per_s()
    rows = []
    for shape in SHAPES:
        rows.append(measure(shape, args.rounds, bandwidth))
        print(rows[-1], flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_tb_per_s": bandwidth,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    lines = [
        f"**Sigmoid group-limited routing on {meta['device']}** (torch {meta['torch']}, "
        f"{meta['date']}; float32 logits, 8192 tokens, renormalized, x {SCALE}; copy "
        f"{bandwidth:.2f} TB/s; medians of {args.rounds} rounds; `bench/topk_sigmoid_cuda.py`)",
        "",
        "| shape | forward floor ms | forward: torchgraft ms (x floor) · the routers' torch ops ms"
        " (x torchgraft) | forward + backward: torchgraft ms · torch ops ms (x torchgraft) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        fwd, fwd_ref = r["torchgraft_forward_ms"], r["torch_ops_forward_ms"]
        both, both_ref = r["torchgraft_forward_backward_ms"], r["torch_ops_forward_backward_ms"]
        lines.append(
            f"| {r['shape']} | {r['floor_ms']:.4f} | {fwd:.4f} ({fwd / r['floor_ms']:.1f}x) · "
            f"{fwd_ref:.4f} ({fwd_ref / fwd:.1f}x) | {both:.4f} · {both_ref:.4f} "
            f"({both_ref / both:.1f}x) |"
        )
    write_rows(args.out, "topk_sigmoid_cuda", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
