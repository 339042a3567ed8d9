"""Writing a benchmark report to disk: JSON, a Markdown table and a PNG plot."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .harness import BenchReport
from .plots import PlotUnavailable, plot_bandwidth
from .table import format_markdown

__all__ = [
    "SHORT_DTYPES",
    "WrittenFiles",
    "device_slug",
    "file_stem",
    "write_results",
    "write_rows",
]

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


def write_rows(
    out_dir: Path, name: str, meta: dict[str, object], rows: list[dict[str, object]], table: str
) -> Path:
    """A standalone GPU benchmark's report (the ``bench/*_cuda.py`` scripts): ``<name>-<gpu>.json``
    (``{"meta", "rows"}``) and ``<name>-<gpu>.md`` (``table``) under ``out_dir``, ``<gpu>`` the
    last word of ``meta["device"]`` lowercased (``h200``). Returns the stem, for a plot beside."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{name}-{str(meta['device']).split()[-1].lower()}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(table)
    return stem
