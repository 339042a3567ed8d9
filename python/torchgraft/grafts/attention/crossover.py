"""Where FA4 beats the SDPA kernel it would replace: the measured table the conds read.

The table is data, ``crossover.json`` beside this module, written by
``bench/attention_fa4.py --write-crossover`` on a GPU. Each row is one measured problem::

    {"arch": "sm90", "baseline": "cudnn", "head_dim": 128, "causal": true, "gqa": false,
     "seq": 8192, "forward": true, "backward": true}

``forward`` / ``backward``: FA4's pass was faster than the baseline's (``"cudnn"`` for
``aten::_scaled_dot_product_cudnn_attention``, ``"flash"`` for ``..._flash_attention``). A call
is matched to the rows of its arch, baseline, head dim, causality and GQA-ness, and takes the
answer of the row whose sequence length is nearest (on a log scale; a tie goes to the shorter).
No matching row means no: unmeasured problems stay on ATen.

``TORCHGRAFT_FA4_CROSSOVER`` overrides the table: a path to another table, ``always`` (FA4
takes every call it can compute) or ``never``; :func:`override` does the same in-process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .support import Problem, arch_name

__all__ = [
    "CROSSOVER_ENV",
    "TABLE_PATH",
    "Row",
    "Table",
    "load_table",
    "override",
    "reload",
    "summary",
    "wins",
]

log = logging.getLogger("torchgraft.grafts.attention")

CROSSOVER_ENV = "TORCHGRAFT_FA4_CROSSOVER"
TABLE_PATH = Path(__file__).with_name("crossover.json")

Baseline = Literal["cudnn", "flash"]
Pass = Literal["forward", "backward"]


@dataclass(frozen=True)
class Row:
    """One measured problem and which of FA4's passes won there."""

    arch: str
    baseline: str
    head_dim: int
    causal: bool
    gqa: bool
    seq: int
    forward: bool
    backward: bool

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> Row:
        """A row from its JSON object (extra keys, such as timings, are ignored)."""
        return cls(
            arch=str(item["arch"]),
            baseline=str(item["baseline"]),
            head_dim=int(item["head_dim"]),
            causal=bool(item["causal"]),
            gqa=bool(item["gqa"]),
            seq=int(item["seq"]),
            forward=bool(item["forward"]),
            backward=bool(item["backward"]),
        )


@dataclass(frozen=True)
class Table:
    """A crossover table, or a fixed answer (``mode`` ``"always"`` / ``"never"``)."""

    rows: tuple[Row, ...] = ()
    mode: Literal["table", "always", "never"] = "table"
    source: str = ""

    def wins(self, baseline: Baseline, which: Pass, problem: Problem) -> bool:
        """Whether FA4's ``which`` pass is expected to beat ``baseline``'s on ``problem``."""
        if self.mode != "table":
            return self.mode == "always"
        arch = arch_name(problem.capability)
        candidates = [
            row
            for row in self.rows
            if row.arch == arch
            and row.baseline == baseline
            and row.head_dim == problem.head_dim
            and row.causal == problem.causal
            and row.gqa == problem.gqa
        ]
        if not candidates:
            return False
        seq = max(problem.seq_q, problem.seq_k)
        nearest = min(candidates, key=lambda row: (abs(math.log2(row.seq / seq)), row.seq))
        return nearest.forward if which == "forward" else nearest.backward


def load_table(path: Path = TABLE_PATH) -> Table:
    """Read a crossover table; a missing or malformed file gives an empty table (never FA4),
    with a warning."""
    try:
        data = json.loads(path.read_text())
        rows = tuple(Row.from_json(item) for item in data["rows"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("FA4 crossover table %s unusable (%s): FA4 takes no call", path, error)
        return Table(source=f"{path} (unusable)")
    return Table(rows=rows, source=str(path))


def _from_env() -> Table | None:
    value = os.environ.get(CROSSOVER_ENV, "").strip()
    if not value:
        return None
    if value.lower() in ("always", "never"):
        return Table(mode=value.lower(), source=f"{CROSSOVER_ENV}={value}")  # type: ignore[arg-type]
    return load_table(Path(value))


_lock = threading.Lock()
_table: Table | None = None
_overrides: list[Table] = []


def current() -> Table:
    """The table in force: an :func:`override`, else ``TORCHGRAFT_FA4_CROSSOVER``, else the
    committed one (read once)."""
    global _table
    if _overrides:
        return _overrides[-1]
    if _table is None:
        with _lock:
            if _table is None:
                _table = _from_env() or load_table()
    return _table


def reload() -> None:
    """Read the table again on next use (after changing the file or the environment)."""
    global _table
    with _lock:
        _table = None


def wins(baseline: Baseline, which: Pass, problem: Problem) -> bool:
    """Whether FA4's ``which`` pass should replace ``baseline``'s on ``problem``."""
    return current().wins(baseline, which, problem)


@contextlib.contextmanager
def override(table: Table | Literal["always", "never"]) -> Iterator[Table]:
    """Use ``table`` (or a fixed answer) inside the block; for tests and benchmarks."""
    chosen = table if isinstance(table, Table) else Table(mode=table, source=f"override {table}")
    _overrides.append(chosen)
    try:
        yield chosen
    finally:
        _overrides.remove(chosen)


def summary() -> str:
    """One line on the table in force, for ``torchgraft list``."""
    table = current()
    if table.mode != "table":
        which = "every" if table.mode == "always" else "no"
        return f"FA4 takes {which} call it can compute ({table.source})"
    archs = sorted({row.arch for row in table.rows})
    return (
        f"FA4 where measured faster: {len(table.rows)} measured problem(s) on "
        f"{', '.join(archs) or 'no GPU'} ({Path(table.source).name})"
    )
