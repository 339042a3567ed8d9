"""A benchmark report as text: a terminal table per mode, and the same as Markdown."""

from __future__ import annotations

from .harness import NOT_SELECTED, BenchReport, Measurement
from .timing import SPREAD_LIMIT

__all__ = ["format_bytes", "format_markdown", "format_ms", "format_terminal"]

NOT_GRAFTED = "*"
NOTE_NOT_GRAFTED = (
    f"{NOT_GRAFTED} the route's graft did not run for this shape (its condition declined): "
    "the kernel below it ran."
)
NOTE_FLOOR = (
    "floor: the memory floor, ms: copies moving the bytes an ideal implementation moves, one "
    "per pass over memory (the forward's, then the backward's), timed as the routes are."
)
NOTE_PEAK = (
    "+N: extra peak memory of one call (torch.cuda.max_memory_allocated over the call minus "
    "what was allocated before it)."
)


def format_ms(value: float) -> str:
    """Milliseconds with three significant digits or so (no exponent)."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_bytes(value: int) -> str:
    """Bytes in binary units, about three significant digits: ``512MiB``, ``2.00GiB``."""
    size = float(value)
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.3g}{unit}"
        size /= 1024
    return f"{size:.3g}GiB"


def _speedup(report: BenchReport, m: Measurement) -> str:
    base = report.lookup(report.baseline, m.mode, m.shape)
    return f"{base.median_ms / m.median_ms:.2f}x" if base is not None else ""


def _cell(report: BenchReport, route: str, mode: str, shape: str, markdown: bool = False) -> str:
    m = report.lookup(route, mode, shape)
    if m is None:
        reason = report.skip_reason(route, mode, shape) or ""
        return "wrong" if reason.startswith("wrong result") else ("error" if reason else "-")
    mark = "" if m.grafted is not False else ("\\" + NOT_GRAFTED if markdown else NOT_GRAFTED)
    speedup = _speedup(report, m)
    if markdown and speedup:
        speedup = f"({speedup})"
    peak = "" if m.extra_peak_bytes is None else f" +{format_bytes(m.extra_peak_bytes)}"
    return f"{format_ms(m.median_ms)} {speedup}{mark}{peak}".strip()


def _mode_title(report: BenchReport, mode: str) -> str:
    what = "forward" if mode == "fwd" else "forward + backward"
    return (
        f"{report.op} {what}, {report.dtype}, {report.device['name']}: "
        f"median ms and speedup vs {report.baseline}"
    )


def _spread_warning(report: BenchReport) -> list[str]:
    """A warning naming the timings whose slowest call took more than SPREAD_LIMIT times the
    fastest (the worst three), or nothing."""
    measured = [*report.copies, *report.floors, *report.measurements]
    spread = [m for m in measured if m.spread is not None and m.spread > SPREAD_LIMIT]
    if not spread:
        return []
    spread.sort(key=lambda m: m.spread or 0.0, reverse=True)
    worst = "; ".join(
        f"{m.route} {m.shape} {m.mode}: min {format_ms(m.min_ms or 0.0)}, median "
        f"{format_ms(m.median_ms)}, max {format_ms(m.max_ms or 0.0)} ms"
        for m in spread[:3]
    )
    return [
        f"WARNING: {len(spread)} of {len(measured)} timings spread more than "
        f"{SPREAD_LIMIT:g}x from their fastest to their slowest call ({worst}): the machine was "
        "busy, so the medians and speedups above are unreliable; run again on a quiet machine."
    ]


def _footer(report: BenchReport) -> list[str]:
    lines = _spread_warning(report)
    if any(m.grafted is False for m in report.measurements):
        lines.append(NOTE_NOT_GRAFTED)
    if any(m.extra_peak_bytes is not None for m in report.measurements):
        lines.append(NOTE_PEAK)
    # One line per (route, reason), naming the shapes and modes it applies to.
    grouped: dict[tuple[str, str], list[str]] = {}
    for skip in report.skips:
        if skip.reason == NOT_SELECTED:
            continue  # the user left it out; the JSON still lists it
        where = " ".join(x for x in (skip.shape, skip.mode) if x)
        grouped.setdefault((skip.route, skip.reason), []).append(where)
    for (route, reason), places in grouped.items():
        named = ", ".join(p for p in places if p)
        lines.append(f"{route} ({named}): {reason}" if named else f"{route}: {reason}")
    return lines


def format_terminal(report: BenchReport, width: int = 120) -> str:
    """Route rows x shape columns per mode, split into column groups that fit ``width``."""
    routes = [*report.tried_routes(), *(["floor"] if report.floors else []), "copy"]
    first = max(len(r) for r in routes) + 2
    out: list[str] = []
    for mode in report.modes:
        out.append(_mode_title(report, mode))
        cells = {(r, s): _row_cell(report, r, mode, s) for r in routes for s in report.shapes}
        col = max([len(s) for s in report.shapes] + [len(c) for c in cells.values()]) + 2
        per_group = max(1, (width - first) // col)
        for start in range(0, len(report.shapes), per_group):
            shapes = report.shapes[start : start + per_group]
            out.append("".ljust(first) + "".join(s.rjust(col) for s in shapes))
            for r in routes:
                out.append(r.ljust(first) + "".join(cells[r, s].rjust(col) for s in shapes))
            out.append("")
    if report.floors:
        out.append(NOTE_FLOOR)
    out.append("copy: x.clone(), ms and GB/s (the bandwidth ceiling).")
    out.extend(_footer(report))
    return "\n".join(out).rstrip() + "\n"


def _row_cell(report: BenchReport, row: str, mode: str, shape: str) -> str:
    """A terminal table cell: a route's, or the floor's or the copy's row."""
    if row == "copy":
        return _copy_cell(report, shape)
    if row == "floor":
        return _floor_cell(report, mode, shape)
    return _cell(report, row, mode, shape)


def _copy_cell(report: BenchReport, shape: str) -> str:
    for c in report.copies:
        if c.shape == shape:
            return f"{format_ms(c.median_ms)} {c.gbps:.3g}GB/s"
    return "-"


def _floor_cell(report: BenchReport, mode: str, shape: str) -> str:
    for f in report.floors:
        if (f.mode, f.shape) == (mode, shape):
            return format_ms(f.median_ms)
    return "-"


def format_markdown(report: BenchReport) -> str:
    """Shape rows x route columns per mode (fits a README), then the skipped routes."""
    routes = report.tried_routes()
    out: list[str] = []
    for mode in report.modes:
        out.append(f"**{_mode_title(report, mode)}**")
        out.append("")
        floor = ["floor"] if report.floors else []
        out.append("| shape | " + " | ".join([*routes, *floor]) + " | copy GB/s |")
        out.append("|---" * (len(routes) + len(floor) + 2) + "|")
        for shape in report.shapes:
            cells = [_cell(report, r, mode, shape, markdown=True) for r in routes]
            cells += [_floor_cell(report, mode, shape) for _ in floor]
            copy = next((f"{c.gbps:.3g}" for c in report.copies if c.shape == shape), "-")
            out.append(f"| {shape} | " + " | ".join(cells) + f" | {copy} |")
        out.append("")
    if report.floors:
        out.append(NOTE_FLOOR)
        out.append("")
    footer = _footer(report)
    if footer:
        escaped = "\\" + NOTE_NOT_GRAFTED  # a bare * would start emphasis
        out.extend(f"- {escaped if line == NOTE_NOT_GRAFTED else line}" for line in footer)
        out.append("")
    return "\n".join(out)
