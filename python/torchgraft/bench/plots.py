"""Bandwidth plots of a benchmark report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .harness import BenchReport, Measurement

__all__ = ["PlotUnavailable", "plot_bandwidth"]


class PlotUnavailable(Exception):
    """No plot can be drawn here (matplotlib is missing)."""


def _points(measurements: list[Measurement], shape_bytes: dict[str, int]) -> tuple[list, list]:
    ordered = sorted(measurements, key=lambda m: (shape_bytes[m.shape], m.shape))
    return [shape_bytes[m.shape] / 2**20 for m in ordered], [m.gbps for m in ordered]


def plot_bandwidth(report: BenchReport, path: Path) -> None:
    """One panel per mode: effective bandwidth against input size, one line per route, the
    measured copy bandwidth dashed as the ceiling. Writes a PNG to ``path``."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("matplotlib is not installed (pip install matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    # Input size in bytes per shape: half of what x.clone() moves.
    shape_bytes = {c.shape: c.bytes // 2 for c in report.copies}
    routes = report.timed_routes()
    fig, axes = plt.subplots(
        1, len(report.modes), figsize=(6.5 * len(report.modes), 4.8), squeeze=False
    )
    for ax, mode in zip(axes[0], report.modes, strict=True):
        for route in routes:
            ms = [m for m in report.measurements if m.route == route and m.mode == mode]
            if ms:
                ax.plot(*_points(ms, shape_bytes), marker="o", markersize=4, label=route)
        if report.copies:
            ax.plot(
                *_points(report.copies, shape_bytes),
                linestyle="--",
                color="black",
                label="copy (x.clone): ceiling",
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_xlabel("input size (MiB)")
        ax.set_ylabel("effective bandwidth (GB/s)")
        what = "forward" if mode == "fwd" else "forward + backward"
        ax.set_title(f"{report.op} {what}, {report.dtype}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    versions = report.versions
    device = report.device["name"]
    if "threads" in report.device:
        device += f", {report.device['threads']} threads"
    fig.suptitle(
        f"{device} - torch {versions['torch']}"
        + (f", triton {versions['triton']}" if versions.get("triton") else ""),
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
