"""Composition: the router's fallback is whatever kernel sat at (op, key) when it was installed.

Order, bottom to top: ATen's kernel <- torch._native's router (torch 2.13+) <- a torchgraft
native kernel <- the torchgraft router, for those that are installed.
"""

from __future__ import annotations

import pytest
import torch

from torchgraft import registry
from torchgraft._registry import torch_native

pytestmark = pytest.mark.usefixtures("clean_overrides")


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
