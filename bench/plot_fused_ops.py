"""One figure of the fused ops' GPU results: forward+backward time of every route, per op.

Reads what ``bench/fused_elementwise_cuda.py`` and ``bench/loss_cuda.py`` wrote (JSON) and
draws one panel per op (SwiGLU, RoPE at head dim 64 and 128, cross-entropy, fused linear
cross-entropy), bars in ms with each route's value written on it, floors as dashed lines:

    python bench/plot_fused_ops.py bench/results/fused_elementwise_cuda-h100.json \\
        bench/results/loss_cuda-h100.json --out bench/results/fused_ops-h100.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

Panel = tuple[str, dict[str, float], float | None]


def _panels(elementwise: dict, loss: dict) -> list[Panel]:
    panels: list[Panel] = []
    swiglu = elementwise["swiglu"]
    panels.append(
        (
            f"SwiGLU {swiglu['shape'][0]}x{swiglu['shape'][1]}",
            {k: v["forward_backward_ms"] for k, v in swiglu["routes"].items()},
            swiglu["floor_ms"]["forward_backward"],
        )
    )
    for rope in elementwise["rope"]:
        panels.append(
            (
                f"RoPE d{rope['head_dim']}, {rope['batch']}x{rope['seq']} tokens",
                {k: v["forward_backward_ms"] for k, v in rope["routes"].items()},
                None,
            )
        )
    ce = loss["cross_entropy"]
    panels.append(
        (
            f"cross-entropy {ce['shape'][0]}x{ce['shape'][1]}",
            {k: v["ms"] for k, v in ce["routes"].items()},
            ce["floors"]["three_pass_ms"],
        )
    )
    lce = loss["linear_cross_entropy"]
    panels.append(
        (
            f"linear + CE {lce['tokens']} tok, {lce['hidden']}->{lce['vocab']}",
            {k: v["ms"] for k, v in lce["routes"].items()},
            lce["floors"]["three_gemms_ms"],
        )
    )
    return panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("elementwise", type=Path)
    parser.add_argument("loss", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    elementwise = json.loads(args.elementwise.read_text())
    loss = json.loads(args.loss.read_text())
    panels = _panels(elementwise, loss)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.6))
    for ax, (title, routes, floor) in zip(axes, panels, strict=True):
        names = list(routes)
        values = [routes[n] for n in names]
        colors = ["tab:green" if n.startswith("torchgraft") else "tab:gray" for n in names]
        bars = ax.barh(names, values, color=colors)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        if floor:
            ax.axvline(floor, color="black", linestyle="--", linewidth=1, label="floor")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("forward + backward, ms (lower is better)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig.suptitle(
        f"torchgraft's fused ops, {elementwise['device']}, torch {elementwise['torch']}, bf16",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
