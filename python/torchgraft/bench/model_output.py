"""A model benchmark's report on disk and on screen: tables, JSON, Markdown and a PNG plot."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from .model import REFERENCE, ModelReport, VariantResult
from .plots import PlotUnavailable
from .results import SHORT_DTYPES, device_slug
from .table import format_ms

__all__ = [
    "ModelFiles",
    "file_stem",
    "format_markdown",
    "format_terminal",
    "plot_model",
    "write_model_results",
]

TOP_OPS = 20
_COLUMNS = (
    "variant",
    "ms/step",
    "vs stock",
    "tokens/s",
    "MFU",
    "peak GiB",
    "max |dloss|",
    "grafts/step",
)


def file_stem(report: ModelReport) -> str:
    """``model_<size>_<family>_<device>_<dtype>``, e.g. ``model_1b_llama_cuda-h100_bf16``."""
    dtype = SHORT_DTYPES.get(report.dtype, report.dtype)
    return f"model_{report.size['name']}_{report.family}_{device_slug(report.device)}_{dtype}"


def _graft_calls(grafts: dict[str, dict[str, int]] | None) -> str:
    if grafts is None:
        return "-"
    return str(sum(g.get("calls", 0) for g in grafts.values()))


def _row(report: ModelReport, r: VariantResult) -> list[str]:
    if r.error is not None:
        return [r.name, "error", "", "", "", "", "", ""]
    return [
        r.name,
        format_ms(r.ms_per_step) if r.ms_per_step is not None else "-",
        f"{r.speedup_vs_stock:.2f}x" if r.speedup_vs_stock is not None else "-",
        f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "-",
        f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-",
        f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-",
        f"{r.max_abs_loss_diff_vs_stock:.2e}" if r.max_abs_loss_diff_vs_stock is not None else "-",
        _graft_calls(r.grafts_per_step),
    ]


def _title(report: ModelReport) -> str:
    size = report.size
    shape = f"{report.parameters / 1e6:,.1f}M parameters"
    experts = size.get("experts")
    if experts is not None:
        shape += (
            f", {report.active_parameters / 1e6:,.1f}M active: top-{experts['per_token']} of "
            f"{experts['count']} experts of {size['mlp']}, {report.experts_implementation} experts;"
        )
    else:
        shape += ","
    return (
        f"{report.family} {size['name']} ({shape} batch {size['batch']} x {size['seq']} "
        f"tokens), {report.dtype}, {report.device['name']}: training step ({report.optimizer})"
    )


def _op_matrix(report: ModelReport) -> tuple[list[str], list[list[str]]]:
    """Ops (the union of every variant's top ops, ranked by their largest self time) x variants."""
    profiled = [r for r in report.variants if r.profile]
    best: dict[str, float] = {}
    for r in profiled:
        for op in r.profile["ops"]:  # type: ignore[index]
            best[op["op"]] = max(best.get(op["op"], 0.0), op["self_ms"])
    ops = sorted(best, key=lambda o: -best[o])[:TOP_OPS]
    header = ["op", *[r.name for r in profiled]]
    rows = []
    for op in ops:
        cells = [op]
        for r in profiled:
            found = next((o for o in r.profile["ops"] if o["op"] == op), None)  # type: ignore[index]
            cells.append(format_ms(found["self_ms"]) if found else "")
        rows.append(cells)
    rows.append(["(step total)", *[format_ms(r.profile["total_ms"]) for r in profiled]])  # type: ignore[index]
    if any(r.profile["unattributed_ms"] for r in profiled):  # type: ignore[index]
        rows.append(
            ["(no op around it)", *[format_ms(r.profile["unattributed_ms"]) for r in profiled]]  # type: ignore[index]
        )
    return header, rows


def _clock(report: ModelReport) -> str:
    profiled = [r for r in report.variants if r.profile]
    return str(profiled[0].profile["clock"]) if profiled else ""  # type: ignore[index]


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *rows]
    ]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


def _notes(report: ModelReport) -> list[str]:
    """Errors, state problems, skipped variants, adoption, global patches, checks."""
    lines = []
    for r in report.variants:
        if r.error:
            lines.append(f"{r.name}: {r.error}")
        for problem in r.state_problems:
            lines.append(f"{r.name}: NOT RESTORED: {problem}")
        if r.notes.get("global_patches"):
            lines.append(
                f"{r.name}: module-global patches, applied around its own steps only: "
                + ", ".join(r.notes["global_patches"])
            )
        if r.graph_breaks:
            lines.append(f"{r.name}: {r.graph_breaks} graph break(s) while compiling")
        if r.graphs_compiled_while_timed:
            lines.append(f"{r.name}: {r.graphs_compiled_while_timed} graph(s) compiled while timed")
    for skip in report.skipped:
        if not skip["reason"].startswith("not selected"):
            lines.append(f"{skip['name']}: not run: {skip['reason']}")
    failed = [name for name, ok in report.checks.items() if ok is False]
    line = "checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed))
    noise = report.checks.get("stock_again_max_abs_loss_diff")
    if noise is not None:
        line += f"; stock-again vs stock max |dloss| {noise:.2e}"
    lines.append(line)
    return lines


_LEGEND = (
    "ms/step: median over {rounds} alternating rounds of {steps} steps; vs stock: stock's "
    "time over the variant's; MFU: the step's FLOPs (model_zoo.flops_per_step; MoE: the "
    "active parameters only) per second over "
    "the GPU's dense bf16 peak (CUDA bf16 on a GPU with a known peak only); peak GiB: "
    "torch.cuda.max_memory_allocated over the loss steps "
    "(not measured on the CPU); max |dloss|: largest difference to stock's loss over "
    "{loss_steps} steps from the same seed; grafts/step: torchgraft graft calls in one step."
)


def format_terminal(report: ModelReport) -> str:
    """The results table, the op breakdown, and the notes."""
    out = [_title(report), ""]
    out += _text_table(list(_COLUMNS), [_row(report, r) for r in report.variants])
    out += ["", _legend(report), ""]
    header, rows = _op_matrix(report)
    if len(header) > 1:
        out.append(f"Top ops of one step ({_clock(report)}, ms):")
        out += _text_table(header, rows)
        out.append("")
    out += _notes(report)
    return "\n".join(out) + "\n"


def _legend(report: ModelReport) -> str:
    return _LEGEND.format(rounds=report.rounds, steps=report.steps, loss_steps=report.loss_steps)


def format_markdown(report: ModelReport) -> str:
    """The same as Markdown, with each variant's grafts and top ops."""
    out = [f"**{_title(report)}**", "", f"`{report.command}`", ""]
    out += _md_table(list(_COLUMNS), [_row(report, r) for r in report.variants])
    out += ["", _legend(report), ""]
    header, rows = _op_matrix(report)
    if len(header) > 1:
        out += [f"**Top ops of one step ({_clock(report)}, ms)**", ""]
        out += _md_table(header, rows)
        out.append("")
    grafted = [r for r in report.variants if r.grafts_per_step]
    if grafted:
        out += ["**Grafts that ran in one step (calls)**", ""]
        for r in grafted:
            per_step = sorted((r.grafts_per_step or {}).items())
            calls = ", ".join(f"`{k}` {v.get('calls', 0)}" for k, v in per_step)
            out.append(f"- {r.name}: {calls}")
        out.append("")
    out += [f"- {line}" for line in _notes(report)]
    return "\n".join(out) + "\n"


def plot_model(report: ModelReport, path: Path) -> None:
    """Four panels: ms/step, peak GiB, loss curves, and each variant's loss minus stock's."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("matplotlib is not installed (pip install matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in report.variants if r.error is None]
    names = [r.name for r in ran]
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    ms = [r.ms_per_step or 0.0 for r in ran]
    bars = ax.bar(names, ms, color=[colors[n] for n in names])
    for bar, r in zip(bars, ran, strict=True):
        if r.speedup_vs_stock is not None:
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            ax.annotate(f"{r.speedup_vs_stock:.2f}x", top, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per training step (median)")
    ax.set_title("step time (lower is better; label: speedup vs stock)")
    ax = axes[0][1]
    if any(r.peak_gib is not None for r in ran):
        ax.bar(names, [r.peak_gib or 0.0 for r in ran], color=[colors[n] for n in names])
        ax.set_ylabel("peak GiB (torch.cuda.max_memory_allocated)")
    else:
        ax.text(0.5, 0.5, "peak memory is not measured on the CPU", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        ax.set_axis_off()
    ax.set_title("peak memory")
    ax = axes[1][0]
    for r in ran:
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.name, color=colors[r.name])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss, same seed and batches ({report.optimizer})")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    stock = report.result(REFERENCE)
    if stock is not None and stock.losses:
        for r in ran:
            if r.name != REFERENCE and len(r.losses) == len(stock.losses):
                diff = [a - b for a, b in zip(r.losses, stock.losses, strict=True)]
                ax.plot(range(1, len(diff) + 1), diff, label=r.name, color=colors[r.name])
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss - stock loss")
    ax.set_title("difference to stock")
    ax.legend(fontsize=8)
    for row in axes:
        for a in row:
            a.grid(True, alpha=0.3)
            for label in a.get_xticklabels():
                label.set_rotation(20)
    versions = report.versions
    fig.suptitle(
        f"{_title(report)}\ntorch {versions['torch']}, transformers {versions.get('transformers')}"
        + (f", liger-kernel {versions['liger_kernel']}" if versions.get("liger_kernel") else ""),
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class ModelFiles:
    """Paths written by :func:`write_model_results`."""

    json: Path
    markdown: Path
    plot: Path | None
    plot_skipped: str | None


def write_model_results(report: ModelReport, out_dir: Path, *, plot: bool = True) -> ModelFiles:
    """Writes ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    json_path = out_dir / f"{stem}.json"
    text = json.dumps(report.to_json(), indent=1, default=str)
    json_path.write_text(text + "\n", encoding="utf-8")
    markdown = out_dir / f"{stem}.md"
    markdown.write_text(format_markdown(report), encoding="utf-8")
    if not plot:
        return ModelFiles(json_path, markdown, None, "--no-plot")
    png = out_dir / f"{stem}.png"
    try:
        plot_model(report, png)
    except PlotUnavailable as why:
        return ModelFiles(json_path, markdown, None, str(why))
    return ModelFiles(json_path, markdown, png, None)
