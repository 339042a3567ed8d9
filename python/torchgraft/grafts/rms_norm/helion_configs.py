"""Which Helion config each RMSNorm kernel runs with: data, chosen per problem, never tuned at
a user's first call.

The table is ``helion_configs.json`` beside this module, written by ``bench/helion_tune.py``
(run once on the GPU the numbers are for). Each entry names a kernel (``"forward"`` or
``"backward"``), a dtype group (``"16bit"`` or ``"float32"``), the hidden size it was tuned at
and the config (Helion's own JSON form, minimized to what differs from Helion's defaults)::

    {"kernel": "forward", "dtypes": "16bit", "hidden": 4096, "config": {"block_sizes": [1]}}

A call takes the entry of its kernel and dtype group with the smallest ``hidden`` at least its
own, else the largest. No entry means Helion's default config (the kernels are built with
``autotune_effort="none"``, so Helion never autotunes behind a user's back).
This module imports no helion.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TABLE_PATH", "Entry", "choose", "dtype_group", "load_entries"]

log = logging.getLogger("torchgraft.grafts.rms_norm")

TABLE_PATH = Path(__file__).with_name("helion_configs.json")


@dataclass(frozen=True)
class Entry:
    """One tuned config."""

    kernel: str
    dtypes: str
    hidden: int
    config: str
    """Helion's JSON form of the config (``helion.Config.from_json`` reads it)."""


def dtype_group(dtype: torch.dtype) -> str:
    """``"float32"`` for float32, ``"16bit"`` for float16 and bfloat16."""
    return "float32" if dtype == torch.float32 else "16bit"


def load_entries(path: Path = TABLE_PATH) -> tuple[Entry, ...]:
    """The table's entries; a missing or malformed file gives none (Helion's defaults), with a
    warning."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return tuple(
            Entry(
                kernel=str(item["kernel"]),
                dtypes=str(item["dtypes"]),
                hidden=int(item["hidden"]),
                config=json.dumps(item["config"], sort_keys=True),
            )
            for item in data["configs"]
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("Helion config table %s unusable (%s): default configs", path, error)
        return ()


@functools.cache
def _entries() -> tuple[Entry, ...]:
    return load_entries()


def choose(kernel: str, dtype: torch.dtype, hidden: int) -> str | None:
    """The config (Helion JSON) for ``kernel`` on rows of ``hidden`` ``dtype`` values, or None
    for Helion's default."""
    group = dtype_group(dtype)
    candidates = sorted(
        (e for e in _entries() if e.kernel == kernel and e.dtypes == group),
        key=lambda e: e.hidden,
    )
    if not candidates:
        return None
    for entry in candidates:
        if entry.hidden >= hidden:
            return entry.config
    return candidates[-1].config
