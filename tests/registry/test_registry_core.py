"""The router: conds in order, impls, fallback to the previous kernel, re-entrancy, mutation."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from conftest import rel_err
from torchgraft import registry

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("clean_overrides")]


def mm64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A real mm override: float64 accumulation, result in the input dtype; calls no mm."""
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1).to(a.dtype)


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 reference, without aten::mm (which the tests override)."""
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


def dump(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def test_matched_calls_run_the_impl_others_fall_back_bitwise():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    small_a = torch.randn(3, 16)
    stock_small = torch.mm(small_a, b)
    calls = []

    def impl(x, y):
        calls.append(x.shape)
        out = torch.empty(x.shape[0], y.shape[1]).fill_(float("nan"))  # poison, then write
        out.copy_(mm64(x, y))
        return out

    registry.register_op_override("test", "aten", "mm", "CPU", lambda x, y: x.shape[0] == 8, impl)

    out = torch.mm(a, b)
    assert calls == [torch.Size([8, 16])]
    assert rel_err(out, ref_mm(a, b)) < 1e-6
    assert torch.equal(torch.mm(small_a, b), stock_small)  # fell back to ATen's kernel
    assert calls == [torch.Size([8, 16])]
    assert registry.override_stats() == {"test/aten::mm/CPU": {"calls": 1, "fallbacks": 1}}


@pytest.mark.parametrize(
    ("spelling", "symbol"),
    [("mm", "mm"), ("mm.default", "mm"), ("aten::mm", "mm"), ("add_.Tensor", "add_.Tensor")],
)
def test_op_symbol_spellings(spelling, symbol):
    info = registry.register_op_override(
        "test", "aten", spelling, "CPU", lambda *a, **k: False, lambda *a, **k: None
    )
    assert info is not None
    assert info.op_symbol == symbol
    assert info.op == f"aten::{symbol}"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lib_symbol": "prims"}, ValueError, "Unsupported lib_symbol"),
        ({"lib_symbol": "_native"}, ValueError, "is not overridable"),
        ({"dispatch_key": "Meta"}, ValueError, "not supported"),
        ({"dispatch_key": "CompositeImplicitAutograd"}, ValueError, "not supported"),
        ({"dispatch_key": "CompositeExplicitAutograd"}, ValueError, "not supported"),
        ({"dispatch_key": "Autograd"}, ValueError, "not supported"),
        ({"dispatch_key": "NotAKey"}, ValueError, "unknown dispatch key"),
        ({"cond": None}, ValueError, "cond must be provided"),
        ({"cond": 3}, TypeError, "cond must be callable"),
        ({"impl": "x"}, TypeError, "impl must be callable"),
        ({"dsl": ""}, ValueError, "dsl"),
    ],
)
def test_bad_registrations_are_refused(kwargs, error, match):
    args = {
        "dsl": "test",
        "lib_symbol": "aten",
        "op_symbol": "mm",
        "dispatch_key": "CPU",
        "cond": lambda *a: True,
        "impl": mm64,
    }
    args.update(kwargs)
    table = dump("aten::mm")
    with pytest.raises(error, match=match):
        registry.register_op_override(
            args["dsl"],
            args["lib_symbol"],
            args["op_symbol"],
            args["dispatch_key"],
            args["cond"],
            args["impl"],
        )
    assert registry.list_overrides() == []
    assert dump("aten::mm") == table


def test_unconditional_override_takes_every_call():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    calls = []

    def impl(x, y):
        calls.append(1)
        return mm64(x, y)

    info = registry.register_op_override(
        "test", "aten", "mm", "CPU", None, impl, unconditional_override=True
    )
    assert info is not None and info.unconditional and info.cond is None
    for _ in range(3):
        assert rel_err(torch.mm(a, b), ref_mm(a, b)) < 1e-6
    assert len(calls) == 3


def test_first_matching_cond_wins_in_registration_order():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ran = []
    registry.register_op_override(
        "first", "aten", "mm", "CPU", lambda x, y: False, lambda x, y: ran.append("first")
    )
    registry.register_op_override(
        "second", "aten", "mm", "CPU", lambda x, y: True, lambda x, y: ran.append("second") or x
    )
    registry.register_op_override(
        "third", "aten", "mm", "CPU", lambda x, y: True, lambda x, y: ran.append("third") or y
    )
    assert torch.mm(a, b) is a
    assert ran == ["second"]
    stats = registry.override_stats()
    assert stats["first/aten::mm/CPU"] == {"calls": 0, "fallbacks": 1}
    assert stats["second/aten::mm/CPU"] == {"calls": 1, "fallbacks": 0}
    assert stats["third/aten::mm/CPU"] == {"calls": 0, "fallbacks": 0}
    assert [i.position for i in registry.list_overrides()] == [0, 1, 2]


def test_cond_exception_propagates_and_leaves_the_guard_clear():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ran = []

    def cond(x, y):
        if x.shape[0] == 4:
            raise KeyError("bug in cond")
        return True

    def impl(x, y):
        ran.append(1)
        return mm64(x, y)

    registry.register_op_override("test", "aten", "mm", "CPU", cond, impl)
    with pytest.raises(KeyError, match="bug in cond"):
        torch.mm(a, b)
    c = torch.randn(6, 4)
    assert rel_err(torch.mm(c, b), ref_mm(c, b)) < 1e-6
    assert ran == [1]  # the router routed again: no stale re-entrancy guard


def test_impl_exception_propagates_and_leaves_the_guard_clear():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    state = {"fail": True, "ran": 0}

    def impl(x, y):
        state["ran"] += 1
        if state["fail"]:
            raise RuntimeError("kernel failed")
        return mm64(x, y)

    registry.register_op_override(
        "test", "aten", "mm", "CPU", None, impl, unconditional_override=True
    )
    with pytest.raises(RuntimeError, match="kernel failed"):
        torch.mm(a, b)
    state["fail"] = False
    assert rel_err(torch.mm(a, b), ref_mm(a, b)) < 1e-6
    assert state["ran"] == 2


def test_reentrant_call_reaches_the_previous_kernel():
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    stock = torch.mm(a, b)
    seen = []

    def impl(x, y):
        seen.append(1)
        return torch.mm(x, y)  # the same op again: must reach ATen, not recurse

    registry.register_op_override(
        "test", "aten", "mm", "CPU", None, impl, unconditional_override=True
    )
    out = torch.mm(a, b)
    assert torch.equal(out, stock)
    assert seen == [1]
    assert registry.override_stats()["test/aten::mm/CPU"] == {"calls": 1, "fallbacks": 1}


def test_reentrant_call_from_nested_ops_reaches_the_previous_kernel():
    x, y = torch.randn(10), torch.randn(10)
    stock = torch.add(x, y, alpha=2.5)
    seen = []

    def impl(a, b, *, alpha=1):
        seen.append(alpha)
        # torch.add and the Tensor.__add__ operator inside reach aten::add.Tensor again.
        return torch.add(a, b * alpha) + torch.zeros_like(a)

    registry.register_op_override(
        "test", "aten", "add.Tensor", "CPU", lambda a, b, **kw: a.numel() == 10, impl
    )
    out = torch.add(x, y, alpha=2.5)
    assert seen == [2.5]
    assert rel_err(out, stock) < 1e-6
    assert registry.override_stats()["test/aten::add.Tensor/CPU"]["fallbacks"] == 2


def test_cond_calling_the_op_does_not_recurse():
    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def cond(x, y):
        return bool(torch.mm(x, y).sum() > float("-inf"))  # the op inside its own cond

    registry.register_op_override("test", "aten", "mm", "CPU", cond, mm64)
    assert rel_err(torch.mm(a, b), ref_mm(a, b)) < 1e-6
    assert registry.override_stats()["test/aten::mm/CPU"] == {"calls": 1, "fallbacks": 0}


def test_reentrancy_guard_is_per_thread():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    inside = threading.Event()
    release = threading.Event()
    threads_seen = []

    def impl(x, y):
        threads_seen.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            inside.set()
            assert release.wait(10)
        return mm64(x, y)

    registry.register_op_override(
        "test", "aten", "mm", "CPU", None, impl, unconditional_override=True
    )
    results = {}

    def run(name):
        results[name] = torch.mm(a, b)

    first = threading.Thread(target=run, args=("first",), name="first")
    first.start()
    assert inside.wait(10)
    # While "first" is inside the impl, another thread's call is routed normally.
    second = threading.Thread(target=run, args=("second",), name="second")
    second.start()
    second.join(10)
    release.set()
    first.join(10)
    assert sorted(threads_seen) == ["first", "second"]
    for name in ("first", "second"):
        assert rel_err(results[name], ref_mm(a, b)) < 1e-6


def test_inplace_override_writes_into_self_and_returns_it():
    x = torch.randn(32)
    y = torch.randn(32)
    expected = x.double() + 0.5 * y.double()
    version = x._version

    def impl(self, other, *, alpha=1):
        self.copy_((self.double() + alpha * other.double()).to(self.dtype))
        return self

    registry.register_op_override(
        "test", "aten", "add_.Tensor", "CPU", lambda s, o, **kw: s.numel() == 32, impl
    )
    out = x.add_(y, alpha=0.5)
    assert out is x
    assert rel_err(x, expected) < 1e-6
    assert x._version > version  # autograd's bookkeeping above the router still ran
    assert registry.override_stats()["test/aten::add_.Tensor/CPU"]["calls"] == 1


def test_inplace_override_returning_a_new_tensor_is_an_error():
    x, y = torch.randn(8), torch.randn(8)
    registry.register_op_override(
        "test",
        "aten",
        "add_.Tensor",
        "CPU",
        lambda s, o, **kw: s.numel() == 8,
        lambda s, o, **kw: s + o,
    )
    with pytest.raises(RuntimeError, match="must return that same tensor"):
        x.add_(y)


def test_out_variant_override_is_checked_against_out():
    a, b = torch.randn(6), torch.randn(6)
    out = torch.full((6,), float("nan"))

    def good(self, other, *, alpha=1, out):
        out.copy_((self.double() + alpha * other.double()).to(out.dtype))
        return out

    registry.register_op_override(
        "test", "aten", "add.out", "CPU", lambda *a, **k: a[0].numel() == 6, good
    )
    result = torch.add(a, b, alpha=3, out=out)
    assert result is out
    assert rel_err(out, a.double() + 3 * b.double()) < 1e-6
    registry.clear_overrides()
    registry.register_op_override(
        "test", "aten", "add.out", "CPU", lambda *a, **k: True, lambda s, o, *, alpha=1, out: s + o
    )
    with pytest.raises(RuntimeError, match="must return that same tensor"):
        torch.add(a, b, out=torch.empty(6))


def test_copy_on_write_inputs():
    base = torch.randn(64)
    saved = base.clone()
    cow = torch._lazy_clone(base)
    assert torch._C._is_cow_tensor(cow)
    other = torch.randn(64)
    seen_cow = []

    def add_impl(self, other, *, alpha=1):
        seen_cow.append(torch._C._is_cow_tensor(self))
        return (self.double() + alpha * other.double()).to(self.dtype)

    def add_inplace(self, other, *, alpha=1):
        self.copy_((self.double() + alpha * other.double()).to(self.dtype))
        return self

    registry.register_op_override(
        "test", "aten", "add.Tensor", "CPU", lambda s, o, **kw: s.numel() == 64, add_impl
    )
    registry.register_op_override(
        "test", "aten", "add_.Tensor", "CPU", lambda s, o, **kw: s.numel() == 64, add_inplace
    )
    # Reading a COW input: correct data, and the input stays lazily shared.
    out = torch.add(cow, other)
    assert seen_cow == [True]
    assert rel_err(out, saved.double() + other.double()) < 1e-6
    assert torch._C._is_cow_tensor(cow)
    # Writing into a COW input: the write lands in it and never in the tensor it shares with.
    cow.add_(other)
    assert torch.equal(base, saved)
    assert rel_err(cow, saved.double() + other.double()) < 1e-6
    assert not torch._C._is_cow_tensor(cow)


def test_copy_on_write_inputs_on_the_fallback_path():
    base = torch.randn(16)
    saved = base.clone()
    cow = torch._lazy_clone(base)
    other = torch.randn(16)
    is_cow = torch._C._is_cow_tensor

    def cond(self, other, **kw):
        return not is_cow(self)  # decline COW inputs, like torch's own overrides do

    registry.register_op_override("test", "aten", "add_.Tensor", "CPU", cond, lambda *a, **k: None)
    cow.add_(other)
    assert torch.equal(base, saved)
    assert torch.equal(cow, saved + other)
    assert registry.override_stats()["test/aten::add_.Tensor/CPU"] == {"calls": 0, "fallbacks": 1}


def test_no_kernel_below_gives_a_clear_error():
    # An op stock PyTorch has no CPU kernel for (and torchgraft grafts none for: the native
    # route keeps its CPU _fused_rms_norm_backward registered once enabled).
    x, mask = torch.randn(3, 5), torch.rand(3, 5) > 0.5
    registry.register_op_override(
        "test", "aten", "_masked_scale", "CPU", lambda *a: False, lambda *a: None
    )
    with pytest.raises(NotImplementedError, match="no torchgraft override at CPU took this call"):
        torch.ops.aten._masked_scale(x, mask, 2.0)


def test_clear_restores_the_dispatcher_exactly_and_counters_stop():
    ops = ["aten::mm", "aten::add.Tensor", "aten::add_.Tensor", "aten::_fused_rms_norm"]
    tables = {op: dump(op) for op in ops}
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    stock = torch.mm(a, b)
    registry.register_op_override("t", "aten", "mm", "CPU", None, mm64, unconditional_override=True)
    registry.register_op_override("t", "aten", "add.Tensor", "CPU", lambda *a, **k: False, mm64)
    registry.register_op_override("t", "aten", "add_.Tensor", "CPU", lambda *a, **k: False, mm64)
    registry.register_op_override(
        "t", "aten", "_fused_rms_norm", "CPU", lambda *a: False, lambda *a: None
    )
    assert all(dump(op) != tables[op] for op in ops)
    torch.mm(a, b)
    node_stats = registry.override_stats()["t/aten::mm/CPU"]
    assert node_stats["calls"] == 1
    registry.clear_overrides()
    assert {op: dump(op) for op in ops} == tables
    assert torch.equal(torch.mm(a, b), stock)
    assert registry.list_overrides() == []
    assert registry.override_stats() == {}


def test_duplicate_registration():
    def cond(x, y):
        return False

    first = registry.register_op_override("test", "aten", "mm", "CPU", cond, mm64)
    again = registry.register_op_override("test", "aten", "mm", "CPU", cond, mm64)
    assert first is not None and again is not None and again.node_id == first.node_id
    assert len(registry.list_overrides()) == 1
    # A second, different override of the same DSL stacks after the first (as in torch._native);
    # allow_multiple_override is accepted and changes nothing.
    ran = []

    def second(x, y):
        ran.append("second")
        return mm64(x, y)

    registry.register_op_override("test", "aten", "mm", "CPU", lambda x, y: True, second)
    registry.register_op_override(
        "test", "aten", "mm", "CPU", lambda x, y: True, mm64, allow_multiple_override=True
    )
    registry.register_op_override("other", "aten", "mm", "CPU", lambda x, y: True, mm64)
    assert [i.stats_key for i in registry.list_overrides()] == [
        "test/aten::mm/CPU",
        "test/aten::mm/CPU#2",
        "test/aten::mm/CPU#3",
        "other/aten::mm/CPU",
    ]
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    assert rel_err(torch.mm(a, b), ref_mm(a, b)) < 1e-6
    assert ran == ["second"]


@pytest.mark.parametrize("op_symbol", ["no_such_op_xyz", "add.NoSuchOverload"])
def test_override_of_an_op_this_torch_lacks_is_kept_inactive(op_symbol):
    table = dump("aten::add.Tensor")
    with pytest.warns(UserWarning, match="does not exist in torch"):
        info = registry.register_op_override(
            "future", "aten", op_symbol, "CPU", None, mm64, unconditional_override=True
        )
    assert info is not None
    assert not info.active and not info.installed and not info.op_available
    (listed,) = registry.list_overrides()
    assert listed.node_id == info.node_id and not listed.active
    assert registry.override_stats() == {
        f"future/aten::{op_symbol}/CPU": {"calls": 0, "fallbacks": 0}
    }
    # Filters and reordering leave it inactive; removing it works like any other.
    registry.reenable_op_overrides(enable_dsl_names="future")
    registry.reorder_overrides(lambda op, key, nodes: nodes)
    assert not registry.list_overrides()[0].active
    assert registry.native_decomp_table(overrides_only=True) == {}
    assert dump("aten::add.Tensor") == table
    assert registry.remove_override(info)
    assert registry.list_overrides() == []


def test_kill_switch(monkeypatch, caplog):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    table = dump("aten::mm")
    monkeypatch.setenv("TORCHGRAFT_DISABLE", "1")
    with caplog.at_level(logging.INFO, logger="torchgraft.registry"):
        info = registry.register_op_override(
            "test", "aten", "mm", "CPU", None, mm64, unconditional_override=True
        )
    assert info is None
    assert "TORCHGRAFT_DISABLE=1" in caplog.text
    assert registry.list_overrides() == []
    assert dump("aten::mm") == table
    # Read at registration time, not at import: switching it off makes registration work again.
    monkeypatch.delenv("TORCHGRAFT_DISABLE")
    assert registry.register_op_override(
        "test", "aten", "mm", "CPU", None, mm64, unconditional_override=True
    )
    torch.mm(a, b)
    assert registry.override_stats()["test/aten::mm/CPU"]["calls"] == 1


def test_list_overrides_and_stats():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    registry.register_op_override("x", "aten", "mm", "CPU", lambda p, q: p.shape[0] == 4, mm64)
    torch.mm(a, b)
    torch.mm(torch.randn(2, 4), b)
    (info,) = registry.list_overrides()
    assert info.dsl == "x" and info.op == "aten::mm" and info.dispatch_key == "CPU"
    assert info.active and info.installed and info.position == 0
    assert not info.unconditional and not info.with_keyset
    assert (info.calls, info.fallbacks) == (1, 1)
    assert info.impl.endswith("mm64")
    assert info.cond is not None and "<lambda>" in info.cond
    assert registry.override_stats() == {"x/aten::mm/CPU": {"calls": 1, "fallbacks": 1}}
    registry.reset_stats()
    assert registry.override_stats() == {"x/aten::mm/CPU": {"calls": 0, "fallbacks": 0}}
