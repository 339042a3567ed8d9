"""Writing a benchmark report to disk: JSON, a Markdown table and a PNG plot."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .harness import BenchReport
from .plots import PlotUnavailable, plot_bandwidth
from .table import format_markdown

__all__ = ["SHORT_DTYPES", "WrittenFiles", "device_slug", "file_stem", "write_results"]

SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def device_slug(device: dict[str, object]) -> str:
    """``"cpu"``, or ``"cuda-h100"`` style: the device kind plus the GPU model when known."""
    kind = str(device["type"])
    if kind != "cuda":
        return kind
    name = str(device.get("name", "")).replace("NVIDIA", "")
    model = re.search(r"[A-Za-z]+\d+[A-Za-z]*", name) or re.search(r"\w+", name)
    return f"cuda-{model.group(0).lower()}" if model else "cuda"


def file_stem(report: BenchReport) -> str:
    """``<op>_<device>_<dtype>``, e.g. ``rms_norm_cuda-h100_bf16``; ``_graph`` appended for
    CUDA-graph timings (``--cuda-graph``), which sit beside the call-by-call ones."""
    dtype = SHORT_DTYPES.get(report.dtype, report.dtype)
    graph = "_graph" if report.cuda_graph else ""
    return f"{report.op}_{device_slug(report.device)}_{dtype}{graph}"


@dataclass(frozen=True)
class WrittenFiles:
    """Paths written by :func:`write_results`."""

    json: Path
    markdown: Path
    plot: Path | None
    """None when no plot was drawn; ``plot_skipped`` says why."""
    plot_skipped: str | None


def write_results(report: BenchReport, out_dir: Path, *, plot: bool = True) -> WrittenFiles:
    """Writes ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    markdown = out_dir / f"{stem}.md"
    markdown.write_text(format_markdown(report), encoding="utf-8")
    if not plot:
        return WrittenFiles(json_path, markdown, None, "--no-plot")
    png = out_dir / f"{stem}.png"
    try:
        plot_bandwidth(report, png)
    except PlotUnavailable as why:
        return WrittenFiles(json_path, markdown, None, str(why))
    return WrittenFiles(json_path, markdown, png, None)
