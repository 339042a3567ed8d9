"""Defining torchgraft's own operators (``torch.ops.torchgraft.*``) from the compiled extension.

Their schemas and CPU / CUDA kernels are defined in Rust (crates/graft-native/src/ops); each op
package adds what only Python can: the fake (meta) function for ``torch.compile`` (``fake.py``)
and the autograd formula (``autograd.py``).
"""

from __future__ import annotations

import threading

__all__ = ["define_ops"]

_lock = threading.Lock()
_defined = False


def define_ops() -> None:
    """Defines the ``torchgraft::`` operators with their kernels (idempotent, thread-safe).

    Raises:
        ImportError: the extension ``torchgraft._native`` is not built.
    """
    global _defined
    with _lock:
        if _defined:
            return
        import torch  # noqa: F401  (libtorch must be loaded before the extension looks it up)

        try:
            from torchgraft import _native
        except ImportError as exc:
            raise ImportError(
                "torchgraft's fused operators need the compiled extension torchgraft._native "
                "(build it with `make build`, or install a torchgraft wheel)"
            ) from exc
        _native.define_ops()
        _defined = True
