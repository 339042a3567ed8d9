"""A one-line progress bar on stderr, for long sweeps (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``[#####.....]  12/40  0:31  <label>``, redrawn in place; silent when not enabled."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()
        self._width = 0

    def advance(self, label: str = "", steps: int = 1) -> None:
        """Count ``steps`` finished steps and redraw with ``label`` (what runs next or ran)."""
        self.done = min(self.total, self.done + steps)
        self._draw(label)

    def show(self, label: str) -> None:
        """Redraw with a new label without counting a step."""
        self._draw(label)

    def close(self) -> None:
        """Clear the bar's line."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _draw(self, label: str) -> None:
        if not self.enabled:
            return
        filled = 30 * self.done // self.total
        elapsed = int(time.monotonic() - self._start)
        line = (
            f"[{'#' * filled}{'.' * (30 - filled)}] {self.done:>{len(str(self.total))}}/"
            f"{self.total}  {elapsed // 60}:{elapsed % 60:02d}  {label}"
        )[:119]
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)
