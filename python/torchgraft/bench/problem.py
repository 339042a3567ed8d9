"""What every benchmark problem has: the op's sizes as given on the command line, a dtype and a
device. Each op's ``Problem`` adds properties that name its sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShapedProblem"]


@dataclass(frozen=True)
class ShapedProblem:
    """One benchmark problem: the op's sizes, dtype, device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def label(self) -> str:
        """The shape as written on the command line, e.g. ``"8x4096x4096"``."""
        return "x".join(str(s) for s in self.shape)
