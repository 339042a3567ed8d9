"""Device helpers the DSL impls and conds share: the current GPU, its compute capability."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import Tensor

__all__ = ["device_capability", "on_device_of"]


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """``(major, minor)`` of CUDA device ``index`` (cached: conds run on every call)."""
    return torch.cuda.get_device_capability(index)


def on_device_of(t: Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make ``t``'s GPU current for the block when it is not already.

    Python kernels get no device guard from the dispatcher; DSL launchers use the current
    device (and its current stream), so a call on ``cuda:1`` must switch to it.
    """
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
