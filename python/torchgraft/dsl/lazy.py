"""A DSL kernel module imported on its first call, never at registration.

Availability checks (:mod:`torchgraft.dsl`) find a DSL without importing it, but an installed
DSL can still fail to import (a wheel built for another CUDA, a torch it does not know). A
:class:`LazyKernels` imports its module once, on the first call that needs it; if that fails it
remembers why, logs one warning, and from then on reports :attr:`LazyKernels.failed` so the
conds decline and every call falls back to the kernel below, instead of raising.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

__all__ = ["LazyKernels"]

log = logging.getLogger("torchgraft.dsl")


class LazyKernels:
    """The kernel module ``module`` (which imports its DSL), imported on first use."""

    def __init__(self, module: str) -> None:
        self.module = module
        self._loaded: ModuleType | None = None
        #: Why the import failed (``"ImportError: ..."``), or None.
        self.error: str | None = None
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        """True once an import was tried and failed (conds read this: it never imports)."""
        return self.error is not None

    def get(self) -> ModuleType | None:
        """The module, imported now if it was not yet; None when its import failed."""
        loaded = self._loaded
        if loaded is not None or self.error is not None:
            return loaded
        with self._lock:
            if self._loaded is None and self.error is None:
                try:
                    self._loaded = importlib.import_module(self.module)
                except Exception as error:  # any import failure means: fall back, once
                    self.error = f"{type(error).__name__}: {error}"
                    log.warning(
                        "%s could not be imported (%s); its overrides fall back to the "
                        "kernels below them from now on",
                        self.module,
                        self.error,
                    )
            return self._loaded

    def reset(self) -> None:
        """Forget a failed import so the next call tries again (for tests and after installs)."""
        with self._lock:
            self._loaded = None
            self.error = None
