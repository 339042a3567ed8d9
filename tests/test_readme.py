"""The README's table of what is grafted says what enable() does."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchgraft import control
from torchgraft.ops.linear_cross_entropy import registration

pytestmark = pytest.mark.default_torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _row(startswith: str) -> list[str]:
    for line in README.read_text().splitlines():
        if line.startswith(f"| {startswith}"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"no README row starting with {startswith!r}")


def test_the_linear_cross_entropy_row_says_enable_installs_it_only_where_a_gpu_is():
    # enable() installs torch's F.linear_cross_entropy override with the native route only where
    # a GPU is (at CPU and CUDA then); on a CPU-only machine it must be registered by hand.
    assert ("native", registration, control._NATIVE_ON_GPU) in control._GRAFTS
    _what, _ops, cpu, cuda = _row("torch 2.14+'s `F.linear_cross_entropy")
    assert cpu != "yes"
    assert "enable()" in cpu and "GPU" in cpu and "registration.register()" in cpu
    assert "enable()" in cuda
