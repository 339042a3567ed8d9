"""The switches: the kill switch, disable()/disabled(), and torchgraft.backends' per-DSL and
per-op switches, on every route (native grafts, registry overrides, the adopted-layer flag)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import _logging, backends, control, native, registry

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

SOFTMAX = "native/aten::_softmax/CPU"
LOG_SOFTMAX = "native/aten::_log_softmax/CPU"
PYTHON_DIR = str(Path(torchgraft.__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _clean(clean_overrides, monkeypatch):
    monkeypatch.delenv("TORCHGRAFT_DISABLE", raising=False)
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    backends.enable_operations(*control._disabled_ops)
    for name in backends.all_dsls:
        getattr(backends, name).enable()
    torchgraft.disable()


def calls(key: str) -> int:
    return torchgraft.stats().get(key, {}).get("calls", 0)


def softmax_grafted() -> bool:
    """Runs F.softmax once and says whether the native graft took it (and it matched stock)."""
    x = torch.randn(4, 16)
    before = calls(SOFTMAX)
    y = F.softmax(x, -1)
    torch.testing.assert_close(y, torch.exp(x) / torch.exp(x).sum(-1, keepdim=True))
    return calls(SOFTMAX) > before


def log_softmax_grafted() -> bool:
    before = calls(LOG_SOFTMAX)
    F.log_softmax(torch.randn(4, 16), -1)
    return calls(LOG_SOFTMAX) > before


def mm_override(dsl: str, ran: list[str]) -> registry.OverrideInfo | None:
    """An override of aten::mm at CPU from ``dsl`` that records that it ran."""

    def impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ran.append(dsl)
        return (a[:, :, None] * b[None, :, :]).sum(1)

    return registry.register_op_override(
        dsl, "aten", "mm", "CPU", None, impl, unconditional_override=True
    )


def mm_ran(ran: list[str]) -> list[str]:
    ran.clear()
    torch.mm(torch.randn(3, 3), torch.randn(3, 3))
    return list(ran)


# ----------------------------------------------------------------- the kill switch


def test_kill_switch_set_before_import_means_nothing_of_torchgraft_runs():
    script = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        import torchgraft
        from torchgraft import control, native, registry
        torchgraft.enable()
        info = registry.register_op_override(
            "mine", "aten", "mm", "CPU", None, lambda a, b: a, unconditional_override=True)
        with torchgraft.enabled():
            F.softmax(torch.randn(4, 8), -1)
            torch.mm(torch.randn(2, 2), torch.randn(2, 2))
        ran = {k: v for k, v in torchgraft.stats().items() if v["calls"]}
        print(info, torchgraft.is_enabled(), native.is_enabled(),
              control.adopted_layers_active("swiglu"), ran, registry.list_overrides())
        """
    )
    env = dict(os.environ, TORCHGRAFT_DISABLE="1", PYTHONPATH=PYTHON_DIR)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "False", "False", "False", "{}", "[]"]


def test_kill_switch_set_after_enable_takes_everything_out_at_the_next_switch(monkeypatch):
    ran: list[str] = []
    torchgraft.enable()
    assert mm_override("mine", ran) is not None
    assert softmax_grafted() and mm_ran(ran) == ["mine"]
    assert control.adopted_layers_active("swiglu")

    monkeypatch.setenv("TORCHGRAFT_DISABLE", "1")
    torchgraft.enable()  # any switch reads it
    assert not torchgraft.is_enabled() and not native.is_enabled()
    assert not control.adopted_layers_active("swiglu")
    assert not softmax_grafted()
    assert mm_ran(ran) == []  # the override registered before the switch was set stays out
    assert mm_override("later", ran) is None  # and registering is a no-op
    assert mm_ran(ran) == []
    with torchgraft.enabled():
        assert not softmax_grafted() and mm_ran(ran) == []

    monkeypatch.delenv("TORCHGRAFT_DISABLE")
    torchgraft.enable()
    assert softmax_grafted() and mm_ran(ran) == ["mine"]
    assert control.adopted_layers_active("swiglu")


def test_registry_reads_the_kill_switch_at_each_change(monkeypatch):
    ran: list[str] = []
    mm_override("mine", ran)
    monkeypatch.setenv("TORCHGRAFT_DISABLE", "1")
    registry.deregister_op_overrides(disable_dsl_names="nobody")  # a change: the switch is read
    assert mm_ran(ran) == []
    assert [o.installed for o in registry.list_overrides()] == [False]
    monkeypatch.delenv("TORCHGRAFT_DISABLE")
    registry.reenable_op_overrides(enable_dsl_names="nobody")
    assert mm_ran(ran) == ["mine"]


# ----------------------------------------------------------------- disable() and disabled()


def test_disabled_turns_every_route_off_and_restores_them():
    ran: list[str] = []
    torchgraft.enable()
    mm_override("mine", ran)
    with torchgraft.disabled():
        assert not torchgraft.is_enabled() and not native.is_enabled()
        assert not control.adopted_layers_active("swiglu")
        assert not softmax_grafted()
        assert mm_ran(ran) == []
    assert torchgraft.is_enabled()
    assert control.adopted_layers_active("swiglu")
    assert softmax_grafted() and mm_ran(ran) == ["mine"]


def test_disabled_restores_after_an_exception_and_when_nested():
    torchgraft.enable()
    with pytest.raises(KeyError):
        with torchgraft.disabled():
            raise KeyError("boom")
    assert torchgraft.is_enabled() and softmax_grafted()
    with torchgraft.disabled():
        with torchgraft.disabled():
            pass
        assert not torchgraft.is_enabled() and not softmax_grafted()  # the outer block holds
    assert torchgraft.is_enabled() and softmax_grafted()
    torchgraft.disable()
    with torchgraft.disabled():
        pass
    assert not torchgraft.is_enabled() and not softmax_grafted()  # it was off before


def test_enable_and_disable_inside_disabled_set_the_state_it_restores():
    with torchgraft.disabled():
        torchgraft.enable()
        assert not torchgraft.is_enabled() and not softmax_grafted()
    assert torchgraft.is_enabled() and softmax_grafted()
    with torchgraft.disabled():
        torchgraft.disable()
    assert not torchgraft.is_enabled() and not softmax_grafted()


def test_disabled_blocks_overlapping_in_threads_keep_torchgraft_off_until_the_last_ends():
    torchgraft.enable()
    inside, release = threading.Barrier(2), threading.Event()
    seen: list[bool] = []

    def worker() -> None:
        with torchgraft.disabled():
            inside.wait()
            release.wait(10)
        seen.append(torchgraft.is_enabled())

    thread = threading.Thread(target=worker)
    thread.start()
    with torchgraft.disabled():
        inside.wait()
    assert not torchgraft.is_enabled()  # the other thread's block is still open
    release.set()
    thread.join(10)
    assert seen == [True] and torchgraft.is_enabled() and softmax_grafted()


def test_disable_keeps_the_users_overrides_and_the_kept_cpu_backward():
    ran: list[str] = []
    torchgraft.enable()
    mm_override("mine", ran)
    torchgraft.disable()
    assert not softmax_grafted() and not control.adopted_layers_active("swiglu")
    assert mm_ran(ran) == ["mine"]  # registered by the user, not by enable()


# ----------------------------------------------------------------- per-op switches


def test_an_op_switched_off_runs_atens_kernel_while_the_other_grafts_run():
    torchgraft.enable()
    backends.disable_operations("_softmax")
    assert backends.is_operation_disabled("aten::_softmax")
    assert not softmax_grafted()  # ATen's kernel: the graft's counter stays still
    assert log_softmax_grafted()
    active = {(g.op, g.dispatch_key): g.active for g in native.grafts()}
    assert active["aten::_softmax", "CPU"] is False
    assert active["aten::_log_softmax", "CPU"] is True
    backends.enable_operations("_softmax")
    assert softmax_grafted()


def test_op_switches_are_sticky_across_enable_and_reach_overrides_and_adopted_layers():
    ran: list[str] = []
    backends.disable_operations("_softmax", "mm", "swiglu")
    torchgraft.enable()
    mm_override("mine", ran)
    assert not softmax_grafted() and log_softmax_grafted()
    assert mm_ran(ran) == []
    assert not control.adopted_layers_active("swiglu")
    assert control.adopted_layers_active("rope")
    backends.enable_operations("mm", "swiglu")
    assert mm_ran(ran) == ["mine"] and control.adopted_layers_active("swiglu")
    assert not softmax_grafted()


def test_operations_disabled_restores_only_what_was_on_even_after_an_exception():
    torchgraft.enable()
    backends.disable_operations("_log_softmax")
    with pytest.raises(KeyError):
        with backends.operations_disabled("_softmax", "_log_softmax"):
            assert not softmax_grafted() and not log_softmax_grafted()
            raise KeyError("boom")
    assert softmax_grafted()
    assert backends.is_operation_disabled("_log_softmax") and not log_softmax_grafted()


# ----------------------------------------------------------------- per-DSL switches


def test_a_dsl_switched_off_stops_its_overrides_only():
    ran: list[str] = []
    torchgraft.enable()
    mm_override("triton", ran)
    mm_override("helion", ran)
    assert mm_ran(ran) == ["triton"]
    backends.triton.enabled = False
    assert not backends.triton.enabled and backends.is_dsl_disabled("triton")
    assert mm_ran(ran) == ["helion"]
    assert softmax_grafted() and control.adopted_layers_active("swiglu")
    with backends.helion.disabled():
        assert mm_ran(ran) == []
    assert mm_ran(ran) == ["helion"]
    backends.triton.enabled = True
    assert mm_ran(ran) == ["triton"]


def test_the_native_dsl_switch_takes_the_native_grafts_and_its_overrides_out():
    ran: list[str] = []
    torchgraft.enable()
    mm_override("native", ran)
    mm_override("triton", ran)
    with pytest.raises(KeyError):
        with backends.native.disabled():
            assert not softmax_grafted() and not log_softmax_grafted()
            assert mm_ran(ran) == ["triton"]
            raise KeyError("boom")
    assert backends.native.enabled
    assert softmax_grafted() and mm_ran(ran) == ["native"]
    backends.native.enabled = False
    torchgraft.disable()
    torchgraft.enable()
    assert not softmax_grafted()  # sticky across enable()


def test_dsl_names_operations_and_availability_mirror_torchs():
    ran: list[str] = []
    mm_override("triton", ran)
    assert backends.all_dsls == ["triton", "cutedsl", "helion", "cutile", "native"]
    assert "native" in backends.available_dsls
    assert set(backends.available_dsls) <= set(backends.all_dsls)
    assert backends.get_dsl_operations("triton") == ["mm"]
    assert {"_softmax", "_fused_rms_norm", "_fused_adam_.tensor_lr"} <= set(
        backends.get_dsl_operations("native")
    )
    assert backends.native.available and "native" in repr(backends.native)
    with pytest.raises(ValueError, match="unknown DSL"):
        backends.DSLController("nosuch")


# ----------------------------------------------------------------- logging


def test_dispatch_log_says_which_override_ran(caplog):
    ran: list[str] = []
    mm_override("mine", ran)
    with caplog.at_level(logging.DEBUG, logger="torchgraft.dispatch"):
        mm_ran(ran)
        torch.add(torch.randn(2), 1)  # not routed: nothing logged
    assert [r.getMessage() for r in caplog.records if r.name == "torchgraft.dispatch"] == [
        "aten::mm at CPU: override mine/aten::mm/CPU ran"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchgraft.dispatch"):
        mm_ran(ran)
    assert not [r for r in caplog.records if r.name == "torchgraft.dispatch"]


def test_torchgraft_logs_environment_sets_the_levels(monkeypatch):
    loggers = [
        logging.getLogger(n) for n in ("torchgraft", "torchgraft.dispatch", "torchgraft.control")
    ]
    saved = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    try:
        monkeypatch.setenv("TORCHGRAFT_LOGS", "+dispatch,control,nosuch")
        _logging.configure_from_env()
        assert logging.getLogger("torchgraft.dispatch").level == logging.DEBUG
        assert logging.getLogger("torchgraft.control").level == logging.INFO
        assert logging.getLogger("torchgraft").handlers
    finally:
        for lg, level, handlers, propagate in saved:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
