"""Stand-in DSL packages on a temporary sys.path entry, for tests without the real ones.

A fake is a package (with a distribution's metadata, so version gates read it) whose modules
either raise on import (proving that registering imports no DSL) or hold a small eager
implementation of the interface torchgraft calls (the fake FA4 in ``fake_fa4.py``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchgraft.dsl import _runtime, cutile

RAISE = "raise ImportError('fake {name}: importing it is what this test forbids')\n"

#: distribution -> (version, importable modules it provides)
FAKE_DISTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "nvidia-cutlass-dsl": ("4.8.1", ("cutlass",)),
    "apache-tvm-ffi": ("0.1.15", ("tvm_ffi",)),
    "flash-attn-4": ("4.0.0b36", ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")),
    "quack-kernels": (
        "0.6.5",
        ("quack", "quack.rmsnorm", "quack.gemm_config", "quack.gemm_interface"),
    ),
    "helion": ("1.4.0", ("helion", "helion.language")),  # fits every torch >= 2.11
}


def write_module(root: Path, module: str, source: str) -> None:
    """Create ``module`` (dotted) under ``root`` as a package with ``source`` as its body."""
    path = root.joinpath(*module.split("."))
    path.mkdir(parents=True, exist_ok=True)
    (path / "__init__.py").write_text(source)


def write_dist(root: Path, name: str, version: str) -> None:
    """Package metadata for distribution ``name`` at ``version``."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def clear_caches() -> None:
    """Forget what the availability checks found (they cache for the process)."""
    importlib.invalidate_caches()
    _runtime.find_module.cache_clear()
    _runtime.package_version.cache_clear()
    cutile.tileiras_version.cache_clear()


def forget_modules_under(root: Path, *also: str) -> None:
    """Drop from sys.modules every module loaded from files under ``root``, and ``also``."""
    prefix = str(root)
    for name, module in list(sys.modules.items()):
        if name in also or (getattr(module, "__file__", None) or "").startswith(prefix):
            del sys.modules[name]


def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty directory first on sys.path; caches are cleared before and after (the body of
    conftest's ``fake_root`` fixture)."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    clear_caches()
    reset_kernel_modules()
    yield root
    monkeypatch.undo()
    # torchgraft's kernel modules imported a fake: they must import the real one next time.
    forget_modules_under(
        root,
        "torchgraft.grafts.attention.fa4_kernels",
        "torchgraft.grafts.grouped_mm.quack_kernels",
        "torchgraft.grafts.rms_norm.quack_kernels",
        "torchgraft.grafts.rms_norm.helion_kernels",
        "torchgraft.grafts.rms_norm.cutile_kernels",
    )
    clear_caches()
    reset_kernel_modules()


def reset_kernel_modules() -> None:
    """Make every lazily imported kernel module import afresh (and forget failed imports)."""
    from torchgraft.grafts.attention.fa4_impl import FA4
    from torchgraft.grafts.grouped_mm.quack_impl import QUACK as QUACK_GEMM
    from torchgraft.grafts.rms_norm.dsl_impl import CUTILE, HELION, QUACK

    for kernels in (FA4, QUACK_GEMM, QUACK, HELION, CUTILE):
        kernels.reset()


def install_raising_dsls(root: Path, versions: dict[str, str] | None = None) -> None:
    """Every fake distribution of :data:`FAKE_DISTS`, each module raising on import."""
    for dist, (version, modules) in FAKE_DISTS.items():
        write_dist(root, dist, (versions or {}).get(dist, version))
        for module in modules:
            write_module(root, module, RAISE.format(name=module))
