"""Per-DSL helpers: availability without importing, version gates, both registration forms."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchgraft import dsl, registry
from torchgraft.dsl import _runtime
from torchgraft.dsl._runtime import DSLRuntime, find_module

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

DSL_MODULES = {"triton": "triton", "cutedsl": "cutlass", "helion": "helion", "cutile": "cuda.tile"}
PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


def test_every_dsl_module_has_the_protocol():
    assert set(dsl.DSLS) == {"triton", "cutedsl", "helion", "cutile", "native"}
    for module in dsl.DSLS.values():
        for name in (
            "runtime_available",
            "runtime_version",
            "register_op_override",
            "deregister_op_overrides",
            "reenable_op_overrides",
        ):
            assert callable(getattr(module, name)), (module.NAME, name)


@pytest.mark.parametrize("name", sorted(DSL_MODULES))
def test_availability_and_version_come_from_metadata(name):
    module = dsl.DSLS[name]
    package = module.PACKAGE
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert module.runtime_available() == (installed is not None)
    version = module.runtime_version()
    assert (str(version) if version is not None else None) == installed


def test_triton_gate_passes_the_triton_that_torch_ships():
    if not dsl.triton.runtime_available():
        pytest.skip("triton is not installed")
    version = dsl.triton.runtime_version()
    assert version is not None and version >= dsl.triton.runtime.min_version
    assert dsl.triton.runtime.unusable_reason() is None  # 3.6.0 (torch 2.11), 3.7.1 (2.13)


def test_native_dsl_tracks_the_extension_module():
    found = find_module("torchgraft._native")
    assert dsl.native.runtime_available() == found


def test_find_module_does_not_import_parents(tmp_path, monkeypatch):
    (tmp_path / "tgns_parent" / "child").mkdir(parents=True)  # a namespace package
    (tmp_path / "tgns_parent" / "child" / "__init__.py").write_text("raise RuntimeError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_module("tgns_parent.child")
    assert not find_module("tgns_parent.missing")
    assert not find_module("tgns_absent_parent.child")
    assert "tgns_parent" not in sys.modules and "tgns_parent.child" not in sys.modules


def make_runtime(**kwargs) -> DSLRuntime:
    options = {"package": "pytest", "module": "pytest", "min_version": "1.0"}
    options.update(kwargs)
    return DSLRuntime("fakedsl", **options)


def test_missing_dsl_skips_registration_with_an_info_log(caplog):
    runtime = make_runtime(package="tg-no-such-dist", module="tg_no_such_module")
    assert not runtime.runtime_available() and runtime.runtime_version() is None
    with caplog.at_level(logging.INFO, logger="torchgraft.dsl.fakedsl"):
        info = runtime.register_op_override("aten", "mm", "CPU", lambda a, b: True, ref_mm)
    assert info is None
    assert "not installed" in caplog.text and "tg_no_such_module" in caplog.text
    assert registry.list_overrides() == []


def test_old_dsl_skips_registration_unless_the_gate_is_skipped(caplog, monkeypatch):
    runtime = make_runtime(min_version="999.0")
    with caplog.at_level(logging.INFO, logger="torchgraft.dsl.fakedsl"):
        assert runtime.register_op_override("aten", "mm", "CPU", lambda a, b: False, ref_mm) is None
    assert "older than the required 999.0" in caplog.text
    monkeypatch.setenv("TORCHGRAFT_SKIP_VERSION_CHECK", "1")
    info = runtime.register_op_override("aten", "mm", "CPU", lambda a, b: False, ref_mm)
    assert info is not None and info.dsl == "fakedsl"


def test_torch_disable_native_jit_skips_dsl_registration(caplog, monkeypatch):
    runtime = make_runtime()
    monkeypatch.setenv("TORCH_DISABLE_NATIVE_JIT", "1")
    with caplog.at_level(logging.INFO, logger="torchgraft.dsl.fakedsl"):
        assert runtime.register_op_override("aten", "mm", "CPU", lambda a, b: True, ref_mm) is None
    assert "TORCH_DISABLE_NATIVE_JIT=1" in caplog.text
    assert registry.list_overrides() == []


def test_kill_switch_also_stops_dsl_registration(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_DISABLE", "1")
    assert (
        make_runtime().register_op_override("aten", "mm", "CPU", lambda a, b: True, ref_mm) is None
    )
    assert registry.list_overrides() == []


def test_torch_213_form_with_cond():
    runtime = make_runtime()
    seen = []

    def impl(a, b):
        seen.append(a.shape[0])
        return ref_mm(a, b).to(a.dtype)

    a, small, b = torch.randn(3, 4), torch.randn(2, 4), torch.randn(4, 2)
    stock_small = torch.mm(small, b)
    info = runtime.register_op_override("aten", "mm", "CPU", lambda a, b: a.shape[0] == 3, impl)
    assert info is not None and not info.with_keyset and not info.unconditional
    out = torch.mm(a, b)
    assert seen == [3]
    assert float((out.double() - ref_mm(a, b)).norm() / ref_mm(a, b).norm()) < 1e-6
    assert torch.equal(torch.mm(small, b), stock_small) and seen == [3]


def test_torch_213_form_by_keyword_and_unconditional():
    runtime = make_runtime()
    seen = []
    info = runtime.register_op_override(
        "aten",
        "mm",
        "CPU",
        cond=None,
        impl=lambda a, b: seen.append(1) or ref_mm(a, b).to(a.dtype),
        unconditional_override=True,
    )
    assert info is not None and info.unconditional and not info.with_keyset
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert seen == [1]
    with pytest.raises(ValueError, match="cond must be provided"):
        runtime.register_op_override("aten", "add.Tensor", "CPU", cond=None, impl=ref_mm)


def test_older_form_impl_gets_the_dispatch_key_set_first():
    runtime = make_runtime()
    seen = []

    def impl(dispatch_keys, a, b):
        seen.append(dispatch_keys)
        if a.shape[0] < 4:
            return torch.ops.aten.mm.default(a, b)  # its own fallback
        return ref_mm(a, b).to(a.dtype)

    small, b = torch.randn(2, 3), torch.randn(3, 5)
    stock = torch.mm(small, b)
    info = runtime.register_op_override("aten", "mm", "CPU", impl, unconditional_override=False)
    assert info is not None and info.with_keyset and not info.unconditional
    out = torch.mm(small, b)
    assert isinstance(seen[0], torch.DispatchKeySet)
    assert seen[0].has(torch.DispatchKey.CPU)
    assert torch.equal(out, stock)  # the re-entrant call reached ATen's kernel
    assert registry.override_stats()["fakedsl/aten::mm/CPU"] == {"calls": 1, "fallbacks": 1}


def test_older_form_unconditional_impl_gets_no_key_set():
    runtime = make_runtime()
    seen = []
    runtime.register_op_override(
        "aten", "mm", "CPU", lambda a, b: seen.append(1) or a, unconditional_override=True
    )
    a = torch.randn(2, 2)
    assert torch.mm(a, torch.randn(2, 2)) is a and seen == [1]


def test_bad_call_shapes():
    runtime = make_runtime()
    with pytest.raises(TypeError, match="missing its impl"):
        runtime.register_op_override("aten", "mm", "CPU")
    with pytest.raises(TypeError, match="takes"):
        runtime.register_op_override("aten", "mm", "CPU", ref_mm, ref_mm, ref_mm)
    with pytest.raises(TypeError, match="cond twice"):
        runtime.register_op_override("aten", "mm", "CPU", ref_mm, cond=None, impl=ref_mm)


def test_per_dsl_deregister_and_reenable(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_SKIP_VERSION_CHECK", "1")
    monkeypatch.setattr(_runtime, "find_module", lambda module: True)  # pretend all DSLs exist
    for name in ("triton", "helion"):
        dsl.DSLS[name].register_op_override("aten", "mm", "CPU", lambda a, b: False, ref_mm)
    dsl.triton.deregister_op_overrides()
    assert {i.dsl: i.active for i in registry.list_overrides()} == {"triton": False, "helion": True}
    dsl.triton.reenable_op_overrides()
    assert all(i.active for i in registry.list_overrides())


def test_no_dsl_is_imported_by_torchgraft_or_by_registering():
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        dsl_modules = {sorted(DSL_MODULES.values())!r}
        before = {{m for m in dsl_modules if m in sys.modules}}
        import torchgraft, torchgraft.registry, torchgraft.dsl
        from torchgraft.dsl import triton as triton_utils
        for module in torchgraft.dsl.DSLS.values():
            module.runtime_available(); module.runtime_version()
        def impl(dispatch_keys, x, normalized_shape, weight, eps):
            from triton_kernels import triton_rms_norm_forward
            return triton_rms_norm_forward(x, normalized_shape, weight, eps)
        info = triton_utils.register_op_override("aten", "_fused_rms_norm", "CUDA", impl)
        registered = info is not None or not triton_utils.runtime_available()
        torchgraft.registry.register_op_override(
            "x", "aten", "mm", "CPU", lambda a, b: False, lambda a, b: a)
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
        torchgraft.registry.clear_overrides()
        after = {{m for m in dsl_modules if m in sys.modules}}
        print("REGISTERED", registered)
        print("NEW", sorted(after - before))
        print("ANY", sorted(after))
        """
    )
    env = {"PYTHONPATH": str(PYTHON_DIR), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["REGISTERED"] == "True"
    assert lines["NEW"] == "[]"
    assert lines["ANY"] == "[]"  # torch itself imports none of them either
