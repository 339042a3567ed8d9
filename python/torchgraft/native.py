"""The native route: Rust (CPU) and CUDA C++ kernels registered through PyTorch's stable C ABI.

The kernels run without Python; this module only switches them on and off and reads their
counters. Everything here is also reachable through :mod:`torchgraft`'s top-level functions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class NativeGraft:
    """A native kernel registered (or registrable) for an aten operator at a dispatch key."""

    op: str
    """Qualified operator name, e.g. ``"aten::_fused_rms_norm"``."""
    dispatch_key: str
    """Dispatch key, e.g. ``"CPU"``."""
    active: bool
    """Whether the kernel is registered now."""
    calls: int
    """Calls since the last reset."""
    fallbacks: int
    """Calls the fused kernel did not cover, computed by a slower general path."""


def available() -> bool:
    """Whether the compiled extension ``torchgraft._native`` is present."""
    return importlib.util.find_spec("torchgraft._native") is not None


def enable(disabled_ops: Iterable[str] = ()) -> None:
    """Register the native kernels with the dispatcher, except those of the ops named in
    ``disabled_ops`` (bare symbols, one overload each: ``"_softmax"``,
    ``"_fused_adam_.tensor_lr"``), which keep the kernels that were there before.

    Idempotent; called again with other ops left out, it registers the kernels again without
    them (all or nothing: on an error the previous registrations are back). The CPU backward of
    RMSNorm is never left out (see :func:`disable`)."""
    import torch  # noqa: F401  (libtorch must be loaded before the extension looks it up)

    from torchgraft import _native

    _native.enable(sorted(set(disabled_ops)))


def disable() -> None:
    """Remove the native kernels, restoring what was registered before (idempotent).

    The CPU backward stays registered once installed: graphs recorded while enabled call it
    whenever their backward runs, and stock PyTorch has no CPU kernel for that op (see
    docs/reliability.md)."""
    if available():
        from torchgraft import _native

        _native.disable()


def is_enabled() -> bool:
    """Whether the native kernels are registered."""
    if not available():
        return False
    from torchgraft import _native

    return bool(_native.is_enabled())


def grafts() -> list[NativeGraft]:
    """Every native graft of this build, with its state and counters."""
    if not available():
        return []
    from torchgraft import _native

    return [NativeGraft(**g) for g in _native.grafts()]


def op_kernels() -> list[NativeGraft]:
    """The kernels of torchgraft's own operators (``torchgraft::swiglu``...) at each dispatch key,
    with their counters; ``active`` once :mod:`torchgraft.functional` has defined them."""
    if not available():
        return []
    from torchgraft import _native

    return [NativeGraft(**g) for g in _native.op_kernels()]


def build_info() -> dict[str, object]:
    """What the extension was built with and found here (version, CUDA kernels, GPUs or why
    the CUDA grafts are off); empty when the extension is not built."""
    if not available():
        return {}
    import torch  # noqa: F401  (the CUDA status asks libtorch)

    from torchgraft import _native

    return dict(_native.build_info())


def cuda_devices() -> int:
    """How many GPUs the native CUDA grafts can run on here (0 without CUDA kernels in this
    build, without CUDA in torch or without a GPU)."""
    devices = build_info().get("cuda_devices")
    return devices if isinstance(devices, int) else 0


def reset_stats() -> None:
    """Zero the native grafts' counters."""
    if available():
        from torchgraft import _native

        _native.reset_stats()
