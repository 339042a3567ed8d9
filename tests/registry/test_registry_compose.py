"""Composition: the router's fallback is whatever kernel sat at (op, key) when it was installed.

Order, bottom to top: ATen's kernel <- torch._native's router (torch 2.13+) <- a torchgraft
native kernel <- the torchgraft router, for those that are installed.
"""

from __future__ import annotations

import logging

import pytest
import torch

from torchgraft import registry
from torchgraft.registry import torch_native

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("clean_overrides")]


def dump(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


class StandInNative:
    """Plays a torchgraft native kernel: a plain aten IMPL kernel for mm at CPU."""

    def __init__(self) -> None:
        self.calls = 0
        self.lib: torch.library.Library | None = None

    def kernel(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return ref_mm(a, b).to(a.dtype)

    def install(self) -> None:
        self.lib = torch.library.Library("aten", "IMPL")
        self.lib.impl("mm", self.kernel, "CPU", allow_override=True)

    def remove(self) -> None:
        assert self.lib is not None
        self.lib._destroy()
        self.lib = None


@pytest.fixture
def native():
    stand_in = StandInNative()
    yield stand_in
    if stand_in.lib is not None:
        with registry.suspend_routers():
            stand_in.remove()


def test_fallback_reaches_a_native_kernel_installed_under_the_router(native):
    stock = dump("aten::mm")
    a, b, big = torch.randn(3, 5), torch.randn(5, 2), torch.randn(9, 5)
    stock_out = torch.mm(a, b)
    ran = []

    def impl(x, y):
        ran.append(x.shape[0])
        return ref_mm(x, y).to(x.dtype)

    registry.register_op_override("dsl", "aten", "mm", "CPU", lambda x, y: x.shape[0] == 9, impl)
    # The lead's enable(): native kernels go in while routers are out, routers return on top.
    with registry.suspend_routers():
        native.install()
    with registry.suspend_routers():
        with_native = dump("aten::mm")

    out = torch.mm(a, b)  # no cond matches -> fallback -> the native kernel
    assert native.calls == 1 and ran == []
    assert torch.allclose(out, stock_out, rtol=1e-5, atol=1e-6)
    torch.mm(big, b)  # the router's own override still wins where its cond holds
    assert ran == [9] and native.calls == 1

    # Deregistering the router leaves exactly the native kernel.
    registry.deregister_op_overrides(disable_dsl_names="dsl")
    assert dump("aten::mm") == with_native
    torch.mm(a, b)
    assert native.calls == 2
    registry.reenable_op_overrides(enable_dsl_names="dsl")

    # The lead's disable(): native kernels leave while routers are out -> fallback is ATen again.
    with registry.suspend_routers():
        native.remove()
        assert dump("aten::mm") == stock
    assert torch.equal(torch.mm(a, b), stock_out)
    assert native.calls == 2
    registry.clear_overrides()
    assert dump("aten::mm") == stock


def test_router_registered_after_native_kernel_needs_no_suspend(native):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    native.install()
    registry.register_op_override("dsl", "aten", "mm", "CPU", lambda x, y: False, lambda x, y: x)
    torch.mm(a, b)
    assert native.calls == 1
    assert registry.override_stats()["dsl/aten::mm/CPU"] == {"calls": 0, "fallbacks": 1}


def _torch_native_registry():
    """torch 2.13+'s cond/impl registry, or None (torch 2.11 has none, 2.12 an older one)."""
    if torch_native.torch_minor() < (2, 13) or torch_native.layout() is None:
        return None
    from torch._native import registry as native_registry

    return native_registry


needs_torch_native = pytest.mark.skipif(
    _torch_native_registry() is None,
    reason="torch._native's cond/impl registry arrived in torch 2.13 (this is torch "
    f"{torch.__version__})",
)


@pytest.fixture
def torch_native_override():
    """A torch._native override of aten::mm at CPU, removed again (with its bookkeeping)."""
    native_registry = _torch_native_registry()
    assert native_registry is not None
    calls = []

    def cond(a, b):
        return a.shape[0] == 5

    def impl(a, b):
        calls.append(a.shape[0])
        return ref_mm(a, b).to(a.dtype)

    stock = dump("aten::mm")
    native_registry.register_op_override("tgtest", "aten", "mm", "CPU", cond, impl)

    def install() -> None:
        native_registry.reenable_op_overrides(enable_dsl_names="tgtest")

    yield native_registry, install, calls
    with registry.suspend_routers():
        native_registry.deregister_op_overrides(disable_dsl_names="tgtest")
    # Forget the test node so later torch._native reinstalls do not bring it back.
    graph = torch_native._graphs().get(("aten", "mm", "CPU"), [])
    graph[:] = [n for n in graph if n.dsl_name != "tgtest"]
    native_registry.reenable_op_overrides(enable_dsl_names="tgtest")
    registry.clear_overrides()
    assert dump("aten::mm") == stock


@needs_torch_native
def test_fallback_reaches_torch_natives_router(torch_native_override):
    _, install, native_calls = torch_native_override
    install()
    ours = []

    def impl(a, b):
        ours.append(a.shape[0])
        return ref_mm(a, b).to(a.dtype)

    registry.register_op_override("dsl", "aten", "mm", "CPU", lambda a, b: a.shape[0] == 7, impl)
    b = torch.randn(4, 3)
    x5, x7, x2 = torch.randn(5, 4), torch.randn(7, 4), torch.randn(2, 4)
    stock2 = (x2.double() @ b.double()).float()
    assert torch.allclose(torch.mm(x5, b), ref_mm(x5, b).float(), atol=1e-6)  # torch._native's
    assert native_calls == [5] and ours == []
    torch.mm(x7, b)  # ours
    assert native_calls == [5] and ours == [7]
    assert torch.allclose(torch.mm(x2, b), stock2, atol=1e-5)  # neither: ATen below both
    assert native_calls == [5] and ours == [7]


@needs_torch_native
def test_torch_native_installed_after_us_sits_on_top(torch_native_override):
    _, install, native_calls = torch_native_override
    ours = []

    def impl(a, b):
        ours.append(a.shape[0])
        return ref_mm(a, b).to(a.dtype)

    registry.register_op_override("dsl", "aten", "mm", "CPU", lambda a, b: a.shape[0] >= 5, impl)
    # Our router does not hold torch.library's Python claim on (mm, CPU): torch._native can
    # still install there (its Library.impl has no allow_override).
    install()
    b = torch.randn(4, 3)
    torch.mm(torch.randn(5, 4), b)  # torch._native's router is on top now
    assert native_calls == [5] and ours == []
    torch.mm(torch.randn(6, 4), b)  # its fallback is our router
    assert ours == [6]


# ---- torch._native rebuilding its router, and choosing which runs first ----------------------


def _tagging(tag: str, ran: list):
    def impl(a, b):
        ran.append((tag, a.shape[0]))
        return ref_mm(a, b).to(a.dtype)

    return impl


def _check_mm(b: torch.Tensor, rows: int) -> None:
    x = torch.randn(rows, b.shape[0])
    assert torch.allclose(torch.mm(x, b), ref_mm(x, b).float(), atol=1e-5)


@needs_torch_native
def test_torch_native_rebuilding_its_router_keeps_ours_working(torch_native_override):
    # torch._native rebuilds its router (its own deregister/reenable, outside suspend_routers):
    # the kernel ours captured goes away. torch 2.15 then raised "SafeKernelFunction has been
    # invalidated" on every call ours passed on; the router now captures what is below again.
    native_registry, install, native_calls = torch_native_override
    install()
    ran: list = []
    registry.register_op_override(
        "dsl", "aten", "mm", "CPU", lambda a, b: a.shape[0] == 7, _tagging("ours", ran)
    )
    b = torch.randn(4, 3)
    native_registry.deregister_op_overrides(disable_dsl_names="tgtest")
    native_registry.reenable_op_overrides(enable_dsl_names="tgtest")
    for rows in (5, 7, 2):
        _check_mm(b, rows)
    assert native_calls == [5] and ran == [("ours", 7)]
    # Taking ours out leaves torch._native's router (now above ours) with a valid capture.
    registry.clear_overrides()
    for rows in (5, 7, 2):
        _check_mm(b, rows)
    assert native_calls == [5, 5] and ran == [("ours", 7)]


@needs_torch_native
def test_choosing_which_registry_runs_first(torch_native_override):
    # Both conds accept 5-row inputs: whichever router is on top takes them.
    native_registry, install, native_calls = torch_native_override
    install()
    ran: list = []
    registry.register_op_override(
        "dsl", "aten", "mm", "CPU", lambda a, b: a.shape[0] in (5, 7), _tagging("ours", ran)
    )
    b = torch.randn(4, 3)
    _check_mm(b, 5)  # default: torchgraft's router was installed last, it runs first
    assert ran == [("ours", 5)] and native_calls == []
    # torch._native first: rebuild its router after ours (any of its control functions).
    native_registry.reenable_op_overrides(enable_op_symbols="mm")
    _check_mm(b, 5)
    _check_mm(b, 7)  # torch._native declines 7: its fallback is our router
    assert native_calls == [5] and ran == [("ours", 5), ("ours", 7)]
    # torchgraft first again: suspend_routers() reinstalls ours on top.
    with registry.suspend_routers():
        pass
    _check_mm(b, 5)
    assert native_calls == [5] and ran == [("ours", 5), ("ours", 7), ("ours", 5)]
    # Only torch._native: switch torchgraft's off (torch._native's router keeps working).
    registry.deregister_op_overrides(disable_dsl_names="dsl")
    _check_mm(b, 5)
    _check_mm(b, 7)
    assert native_calls == [5, 5] and len(ran) == 3
    registry.reenable_op_overrides(enable_dsl_names="dsl")
    # Only torchgraft: switch torch._native's off with its own function.
    with registry.suspend_routers():
        native_registry.deregister_op_overrides(disable_op_symbols="mm")
    _check_mm(b, 5)
    _check_mm(b, 2)
    assert native_calls == [5, 5] and ran[-1] == ("ours", 5)
    native_registry.reenable_op_overrides(enable_op_symbols="mm")


def test_torch_native_layout_is_known_on_every_supported_torch():
    minor = torch_native.torch_minor()
    if minor < (2, 12):
        assert torch_native.layout() is None and torch_native.overrides() == []
    else:
        assert minor > max(torch_native.LAYOUTS) or minor in torch_native.LAYOUTS
        assert torch_native.layout() is not None
        for o in torch_native.overrides():  # whatever this torch registered at import
            assert o.op.startswith(f"{o.lib_symbol}::") and isinstance(o.active, bool)


def test_unknown_torch_native_layout_is_left_alone(monkeypatch, caplog):
    # A torch whose torch._native lacks what the newest known layout reads: nothing is read
    # or rebuilt (one warning), and listing shows no torch._native rows instead of crashing.
    if torch_native._registry() is None:
        pytest.skip(f"torch {torch.__version__} has no torch._native")
    newest = max(torch_native.LAYOUTS)
    broken = torch_native.Layout(
        torch_native._key3,
        torch_native._split3,
        "_no_such_libs",
        torch_native._rebuild_215,
        "_no_such_function",
    )
    monkeypatch.setitem(torch_native.LAYOUTS, newest, broken)
    monkeypatch.setattr(torch_native, "torch_minor", lambda: newest)
    torch_native.layout.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="torchgraft.registry"):
            assert torch_native.layout() is None
        assert "_no_such_libs" in caplog.text
        assert torch_native.overrides() == []
        assert torch_native.router_token("mm", "CPU") is None
        assert torch_native.reinstall("mm", "CPU") is False
    finally:
        torch_native.layout.cache_clear()


def test_torch_native_overrides_are_listed(monkeypatch):
    # `torchgraft list` used to unpack torch._native's graph keys, which have three parts on
    # torch 2.15: it crashed. It now reads them through the version table.
    from torchgraft import cli

    if torch_native.layout() is None:
        pytest.skip(f"torch {torch.__version__} has no torch._native")
    import torch._native.registry as native_registry

    if torch_native.torch_minor() >= (2, 13):
        native_registry.register_op_override(
            "tglist", "aten", "mm", "CPU", lambda *a: False, lambda a, b: a
        )
    else:  # torch 2.12: keyset-first impls, no cond
        native_registry.register_op_override("tglist", "aten", "mm", "CPU", lambda ks, a, b: a)
    try:
        listed = [o for o in torch_native.overrides() if o.dsl == "tglist"]
        assert [(o.op, o.dispatch_key, o.active) for o in listed] == [("aten::mm", "CPU", True)]
        assert torch_native.active("mm", "CPU")
        rows = [r for r in cli.list_rows() if r["route"] == "torch._native/tglist"]
        assert [(r["op"], r["dispatch_key"], r["state"]) for r in rows] == [
            ("aten::mm", "CPU", "active")
        ]
    finally:
        graph = torch_native._graphs().get(("aten", "mm", "CPU"), [])
        graph[:] = [n for n in graph if n.dsl_name != "tglist"]
    assert not torch_native.active("mm", "CPU")
