"""``TORCHGRAFT_LOGS``: turn torchgraft's loggers on from the environment, as ``TORCH_LOGS`` does.

``TORCHGRAFT_LOGS=+dispatch`` logs, for every call a registry router takes, which override ran
(or that the kernel below did); ``TORCHGRAFT_LOGS=control,registry`` logs what the switches
install and remove. Each comma-separated name is a logger under ``torchgraft`` (or ``all`` for
``torchgraft`` itself); ``+name`` sets DEBUG, ``name`` INFO, ``-name`` ERROR. Read once, when
torchgraft is imported; ``logging.getLogger("torchgraft.<name>").setLevel(...)`` does the same at
any time (with a handler of your own).
"""

from __future__ import annotations

import logging
import os

__all__ = ["LOGGERS", "LOGS_ENV", "configure_from_env"]

LOGS_ENV = "TORCHGRAFT_LOGS"

#: Names ``TORCHGRAFT_LOGS`` takes, and what each logger reports.
LOGGERS = {
    "all": "everything below",
    "dispatch": "each call a registry router takes: the override that ran, or the kernel below",
    "control": "enable(), disable(), the kill switch and the per-DSL and per-op switches",
    "registry": "overrides registered, filtered, routers installed and removed",
    "dsl": "DSL runtimes found, skipped registrations",
    "ops": "op packages registered or skipped",
}

_PREFIX_LEVELS = {"+": logging.DEBUG, "-": logging.ERROR}


def configure_from_env() -> None:
    """Apply ``TORCHGRAFT_LOGS`` (nothing when it is unset or empty).

    Sets each named logger's level and gives the ``torchgraft`` logger one handler to stderr
    (not propagated to the root logger, so lines are not printed twice), unless it has one.
    Unknown names are reported with a warning and skipped.
    """
    spec = os.environ.get(LOGS_ENV, "").strip()
    if not spec:
        return
    root = logging.getLogger("torchgraft")
    unknown = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        level = _PREFIX_LEVELS.get(item[0], logging.INFO)
        name = item.lstrip("+-")
        if name not in LOGGERS:
            unknown.append(item)
            continue
        logger = root if name == "all" else logging.getLogger(f"torchgraft.{name}")
        logger.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        root.addHandler(handler)
        root.propagate = False
    if unknown:
        root.warning(
            "%s: unknown name(s) %s; known: %s", LOGS_ENV, ", ".join(unknown), ", ".join(LOGGERS)
        )
