"""Shared pytest fixtures and markers for torchgraft's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads the
# switch once, when first imported (torch.compile imports it too), so set it before any test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Every test chooses where it runs: ``compat`` (the compatibility set, run on every supported
# torch) or ``default_torch`` (the default torch only). A module sets one in ``pytestmark``; a
# test in a ``default_torch`` module may add ``compat``.
_RUN_SETS = ("compat", "default_torch")


def _require_run_set(items: list[pytest.Item]) -> None:
    unmarked = sorted({item.nodeid.split("::")[0] for item in items if not _run_set(item)})
    if unmarked:
        raise pytest.UsageError(
            "tests must be marked `compat` or `default_torch` (tests/conftest.py says why): "
            + ", ".join(unmarked)
        )


def _run_set(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in _RUN_SETS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Require a run set on every test; skip tests marked ``cuda`` when no GPU is usable."""
    _require_run_set(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_overrides() -> Iterator[None]:
    """Start and end the test with no torchgraft override registered (dispatcher restored)."""
    from torchgraft import registry

    registry.clear_overrides()
    yield
    registry.clear_overrides()


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory first on sys.path for stand-in DSL packages (see dsl_fakes.py)."""
    from dsl_fakes import fake_site

    yield from fake_site(tmp_path, monkeypatch)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    return float((out64 - ref64).norm() / ref64.norm())


def rel_err_in(out: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`rel_err` for a result rounded to ``out.dtype``: values below the dtype's smallest
    normal number lose relative precision (float16 subnormals, underflow to 0), so the norm of
    the reference gets that floor per element."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    floor = torch.finfo(out.dtype).tiny * max(ref64.numel(), 1) ** 0.5
    return float((out64 - ref64).norm() / (ref64.norm() + floor))
