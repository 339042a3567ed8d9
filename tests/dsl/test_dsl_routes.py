"""The DSL routes' gates and registration, on CPU: versions checked without importing, nothing
imported by registering, a failed import falling back to the kernel below."""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._vendor.packaging.version import Version

import torchgraft
from dsl_fakes import (
    FAKE_DISTS,
    clear_caches,
    install_raising_dsls,
    write_dist,
    write_module,
)
from torchgraft import registry
from torchgraft.dsl import cutedsl, cutile, helion
from torchgraft.dsl.lazy import LazyKernels
from torchgraft.grafts.rms_norm import dsl_impl

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


# ---- helion: which helion fits which torch ---------------------------------------------------


@pytest.mark.parametrize(
    ("helion_version", "torch_version", "fits"),
    [
        ("1.5.1", "2.11.0", False),  # seen on the H100: import fails
        ("1.5.0", "2.12.0", False),  # untried: the gate asks for a torch known to work
        ("1.5.1", "2.13.0", True),
        ("1.5.1", "2.15.0", True),
        ("1.4.0", "2.11.0", True),  # seen working on the H100
        ("1.2.0", "2.11.0", True),
    ],
)
def test_helion_torch_table(helion_version, torch_version, fits):
    reason = helion.torch_compat_reason(Version(helion_version), Version(torch_version))
    assert (reason is None) == fits
    if not fits:
        assert "needs torch >=" in reason and "1.4.0" in reason


def test_torch_release_drops_local_and_dev_parts():
    assert helion.torch_release("2.11.0+cu130") == Version("2.11.0")
    assert helion.torch_release("2.13.0.dev20260101+cu130") == Version("2.13.0")


def test_helion_gate_uses_the_installed_pair(fake_root, monkeypatch, caplog):
    write_dist(fake_root, "helion", "1.5.1")
    write_module(fake_root, "helion", "raise ImportError('not to be imported')\n")
    clear_caches()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    reason = helion.runtime.unusable_reason()
    assert reason is not None and "helion 1.5.1 needs torch >= 2.13" in reason
    with caplog.at_level(logging.INFO, logger="torchgraft.dsl.helion"):
        assert (
            helion.register_op_override("aten", "mul.Tensor", "CPU", lambda *a: True, None) is None
        )
    assert "needs torch" in caplog.text
    monkeypatch.setenv("TORCHGRAFT_SKIP_VERSION_CHECK", "1")
    assert helion.runtime.unusable_reason() is None
    assert "helion" not in sys.modules or not sys.modules["helion"].__file__.startswith(
        str(fake_root)
    )


# ---- CuteDSL kernel libraries ----------------------------------------------------------------


def test_libraries_usable_when_installed_in_range(fake_root):
    install_raising_dsls(fake_root)
    clear_caches()
    for name in cutedsl.LIBRARIES:
        assert cutedsl.library_unusable_reason(name) is None, name
        assert cutedsl.library_version(name) == Version(FAKE_DISTS[name][0])


def test_library_versions_outside_the_range_are_refused(fake_root, monkeypatch):
    install_raising_dsls(fake_root, {"flash-attn-4": "4.0.0b30", "quack-kernels": "0.7.0"})
    clear_caches()
    fa4 = cutedsl.library_unusable_reason("flash-attn-4")
    quack = cutedsl.library_unusable_reason("quack-kernels")
    assert fa4 is not None and "4.0.0b30 is outside the accepted versions (>= 4.0.0b36, < 5)" in fa4
    assert quack is not None and "0.7.0 is outside" in quack
    monkeypatch.setenv("TORCHGRAFT_SKIP_VERSION_CHECK", "1")
    assert cutedsl.library_unusable_reason("flash-attn-4") is None


def test_library_needs_cutedsl_and_tvm_ffi(fake_root):
    write_dist(fake_root, "flash-attn-4", "4.0.0b36")
    write_module(fake_root, "flash_attn.cute", "raise ImportError\n")
    clear_caches()
    assert "cutedsl is not installed" in cutedsl.library_unusable_reason("flash-attn-4")
    write_dist(fake_root, "nvidia-cutlass-dsl", "4.8.1")
    write_module(fake_root, "cutlass", "raise ImportError\n")
    clear_caches()
    reason = cutedsl.library_unusable_reason("flash-attn-4")
    assert reason == "flash-attn-4 needs module(s) tvm_ffi, which are not installed"
    assert "quack-kernels is not installed" in cutedsl.library_unusable_reason("quack-kernels")


# ---- cuTile: tileiras ------------------------------------------------------------------------


def _fake_cutile(root: Path) -> None:
    write_dist(root, "cuda-tile", "1.7.0")
    write_module(root, "cuda.tile", "raise ImportError\n")
    # cuda stays a namespace package (no __init__.py), as cuda-bindings leaves it
    clear_caches()


def test_cutile_without_tileiras_is_unusable(fake_root, monkeypatch):
    _fake_cutile(fake_root)
    monkeypatch.setenv("PATH", str(fake_root / "nobin"))
    monkeypatch.setenv("CUDA_HOME", str(fake_root / "nocuda"))
    monkeypatch.setattr(cutile, "_tileiras_binary", lambda: None)
    assert cutile.runtime_available()
    reason = cutile.runtime.unusable_reason()
    assert reason is not None and "tileiras compiler is not" in reason
    assert cutile.arch_unusable_reason(9) == "no tileiras compiler found"


def test_cutile_tileiras_version_decides_hopper(fake_root, monkeypatch):
    _fake_cutile(fake_root)
    bin_dir = fake_root / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "tileiras"
    tool.write_text("#!/bin/sh\necho 'Cuda compiler driver, release 13.1, V13.1.80'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    clear_caches()
    assert cutile.tileiras_version() == Version("13.1")
    assert cutile.runtime.unusable_reason() is None
    assert cutile.arch_unusable_reason(10) is None
    assert cutile.arch_unusable_reason(9) == "tileiras 13.1 cannot compile for sm9x (needs >= 13.3)"
    write_dist(fake_root, "nvidia-cuda-tileiras", "13.3.0")  # the wheel wins over a toolkit
    clear_caches()
    assert cutile.arch_unusable_reason(9) is None


def _fake_cutile_toolchain(root: Path, nvcc: str | None, nvvm: str | None) -> None:
    _fake_cutile(root)
    write_dist(root, "nvidia-cuda-tileiras", "13.4.92")
    for package, version in (("nvidia-cuda-nvcc", nvcc), ("nvidia-nvvm", nvvm)):
        if version is not None:
            write_dist(root, package, version)
    clear_caches()


def test_cutile_tileiras_wheel_needs_its_nvcc_and_nvvm(fake_root):
    # Seen on the H100: with only the tileiras wheel every compile fails without detail
    # (tileiras finds no libNVVM beside it). This venv may hold nvcc/nvvm 13.0 wheels: also wrong.
    _fake_cutile_toolchain(fake_root, nvcc="13.4.92", nvvm=None)
    reason = cutile.runtime.unusable_reason()
    assert reason is not None
    assert "nvidia-cuda-tileiras 13.4.92 needs nvidia-cuda-nvcc and nvidia-nvvm 13.4.x" in reason
    assert "failed to compile Tile IR program" in reason
    _fake_cutile_toolchain(fake_root, nvcc="13.4.92", nvvm="13.4.92")
    assert cutile.runtime.unusable_reason() is None
    assert cutile.arch_unusable_reason(9) is None
    assert cutile.toolchain() == {
        "nvidia-cuda-tileiras": "13.4.92",
        "nvidia-cuda-nvcc": "13.4.92",
        "nvidia-nvvm": "13.4.92",
    }


def test_cutile_route_without_its_toolchain_registers_nothing_and_says_why(fake_root, caplog):
    _fake_cutile_toolchain(fake_root, nvcc=None, nvvm=None)
    torchgraft.disable()
    with caplog.at_level(logging.INFO, logger="torchgraft"):
        torchgraft.enable(routes=["cutile"])
    try:
        assert [o for o in registry.list_overrides() if o.dsl == "cutile"] == []
        assert "skipping the cutile override of aten::_fused_rms_norm at CUDA" in caplog.text
        assert "needs nvidia-cuda-nvcc and nvidia-nvvm 13.4.x" in caplog.text
    finally:
        torchgraft.disable()


def test_doctor_shows_cutile_toolchain(fake_root, capsys):
    from torchgraft import cli

    _fake_cutile_toolchain(fake_root, nvcc="13.4.92", nvvm=None)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^  cutile\s+1\.7\.0 \(not used: nvidia-cuda-tileiras 13\.4\.92 needs", out, re.M
    )
    assert re.search(r"^    tileiras\s+13\.4\.92$", out, re.M)
    assert re.search(r"^    nvidia-cuda-nvcc\s+13\.4\.92$", out, re.M)
    assert re.search(r"^    nvidia-nvvm\s+(not installed|13\.0\.\d+)$", out, re.M)


# ---- registration imports nothing; enable() routes -------------------------------------------

_SUBPROCESS = """
import sys
import torch
if {pretend_gpu!r}:
    # enable() installs CUDA overrides by default only where a GPU is; registering needs none.
    torch.cuda.is_available = lambda: True
import torchgraft
from torchgraft import list_overrides
torchgraft.enable(routes={routes!r})
routes = sorted({{(o.dsl, o.op_symbol) for o in list_overrides()}})
print(routes)
loaded = [m for m in ("cutlass", "tvm_ffi", "flash_attn", "quack", "helion", "cuda.tile")
          if m in sys.modules]
print("LOADED", loaded)
"""


def _run_enable(
    root: Path, routes: list[str] | None, pretend_gpu: bool = False
) -> tuple[list[tuple[str, str]], list[str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(PYTHON_DIR)]))
    env.pop("TORCHGRAFT_DISABLE", None)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_SUBPROCESS.format(routes=routes, pretend_gpu=pretend_gpu)),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    return eval(lines[-2]), eval(lines[-1].removeprefix("LOADED "))


def test_registering_every_dsl_route_imports_no_dsl(fake_root):
    install_raising_dsls(fake_root)
    _fake_cutile_toolchain(fake_root, nvcc="13.4.92", nvvm="13.4.92")
    overrides, loaded = _run_enable(fake_root, ["triton", "cutedsl", "helion", "cutile"])
    assert loaded == []
    sdpa = [
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
    ]
    rms = ["_fused_rms_norm", "_fused_rms_norm_backward"]
    expected = {("cutedsl", op) for op in [*sdpa, *rms, "_grouped_mm"]} | {
        (dsl, op) for dsl in ("helion", "cutile") for op in rms
    }
    if cutedsl_triton_usable():
        expected |= {("triton", op) for op in rms}
    assert set(overrides) == expected


def test_default_enable_takes_fa4_and_quack_grouped_mm_not_the_opt_in_rms_norm(fake_root):
    install_raising_dsls(fake_root)
    # Without a GPU the default installs no CUDA override at all.
    overrides, loaded = _run_enable(fake_root, None)
    assert loaded == [] and not [o for o in overrides if o[0] in ("cutedsl", "helion")]
    overrides, loaded = _run_enable(fake_root, None, pretend_gpu=True)
    assert loaded == []
    dsl_routes = {(dsl, op) for dsl, op in overrides if dsl in ("cutedsl", "helion")}
    assert dsl_routes == {
        ("cutedsl", "_scaled_dot_product_cudnn_attention"),
        ("cutedsl", "_scaled_dot_product_cudnn_attention_backward"),
        ("cutedsl", "_scaled_dot_product_flash_attention"),
        ("cutedsl", "_scaled_dot_product_flash_attention_backward"),
        ("cutedsl", "_grouped_mm"),
    }


def test_missing_libraries_register_nothing_and_say_why(caplog):
    if cutedsl.library_unusable_reason("flash-attn-4") is None:
        pytest.skip("flash-attn-4 is installed here")
    torchgraft.disable()
    with caplog.at_level(logging.INFO):
        torchgraft.enable(routes=["cutedsl"])
    try:
        assert [o for o in registry.list_overrides() if o.dsl == "cutedsl"] == []
        assert "FA4 attention overrides not registered" in caplog.text
        assert "RMSNorm cutedsl overrides not registered" in caplog.text
        assert "quack grouped_mm override not registered" in caplog.text
    finally:
        torchgraft.disable()


def cutedsl_triton_usable() -> bool:
    from torchgraft.dsl import triton

    return triton.runtime.unusable_reason() is None


# ---- a failed import falls back ----------------------------------------------------------------


def test_lazy_kernels_remember_a_failed_import(caplog):
    kernels = LazyKernels("torchgraft_tests_no_such_module")
    assert not kernels.failed
    with caplog.at_level(logging.WARNING, logger="torchgraft.dsl"):
        assert kernels.get() is None
        assert kernels.get() is None
    assert kernels.failed and kernels.error.startswith("ModuleNotFoundError")
    assert caplog.text.count("could not be imported") == 1
    kernels.reset()
    assert not kernels.failed


def test_lazy_kernels_import_once():
    kernels = LazyKernels("json")
    module = kernels.get()
    assert module is sys.modules["json"] and kernels.get() is module and not kernels.failed


def test_broken_dsl_falls_back_to_the_kernel_below(monkeypatch):
    # quack's forward impl registered at CPU (where ATen has a kernel to fall back to), with a
    # kernel module that cannot be imported: the call reaches ATen, and the conds decline from
    # then on without trying again.
    monkeypatch.setattr(dsl_impl.QUACK, "module", "torchgraft_tests_broken_quack")
    dsl_impl.QUACK.reset()
    try:
        registry.register_op_override(
            "cutedsl",
            "aten",
            "_fused_rms_norm",
            "CPU",
            lambda *a: True,
            dsl_impl.quack_forward_impl,
        )
        x = torch.randn(6, 32, dtype=torch.float64)
        w = torch.randn(32, dtype=torch.float64)
        y, rstd = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
        assert registry.override_stats()["cutedsl/aten::_fused_rms_norm/CPU"] == {
            "calls": 1,
            "fallbacks": 1,
        }
        assert dsl_impl.QUACK.failed
        registry.clear_overrides()
        y_aten, rstd_aten = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
        assert torch.equal(y, y_aten) and torch.equal(rstd, rstd_aten)
        from torchgraft.grafts.rms_norm.registration import notes

        assert notes()[("cutedsl", "_fused_rms_norm")].startswith("nothing: import failed")
    finally:
        monkeypatch.undo()
        dsl_impl.QUACK.reset()
