"""Control: filters, ordering functions, suspend_routers, clear."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch

from torchgraft import registry

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]


def dump(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def tagging_impl(tag: str, log: list[str]):
    """An mm impl that records its tag and returns a correct result (no aten::mm inside)."""

    def impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        log.append(tag)
        return (a[:, :, None] * b[None, :, :]).sum(1)

    return impl


def always(*args, **kwargs) -> bool:
    return True


@pytest.fixture
def three_dsls():
    """Overrides of aten::mm at CPU from dsls a, b, c (in that order) and of add.Tensor from b."""
    ran: list[str] = []
    for dsl in ("a", "b", "c"):
        registry.register_op_override(dsl, "aten", "mm", "CPU", always, tagging_impl(dsl, ran))
    registry.register_op_override(
        "b", "aten", "add.Tensor", "CPU", lambda s, o, **k: s.numel() == 7, lambda s, o, **k: s
    )
    return ran


def mm_once(ran: list[str]) -> str | None:
    ran.clear()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    torch.mm(a, b)
    return ran[0] if ran else None


def test_deregister_by_dsl_then_reenable(three_dsls):
    ran = three_dsls
    assert mm_once(ran) == "a"
    registry.deregister_op_overrides(disable_dsl_names="a")
    assert mm_once(ran) == "b"
    registry.deregister_op_overrides(disable_dsl_names=["b", "c"])
    assert mm_once(ran) is None
    assert all(not i.active for i in registry.list_overrides())
    registry.reenable_op_overrides(enable_dsl_names=["a", "b", "c"])
    assert mm_once(ran) == "a"


def test_deregister_by_op_symbol(three_dsls):
    ran = three_dsls
    x = torch.randn(7)
    with registry.suspend_routers():
        stock_add = dump("aten::add.Tensor")
    registry.deregister_op_overrides(disable_op_symbols="mm")
    assert mm_once(ran) is None
    assert torch.add(x, x) is x  # add.Tensor of dsl b is still live
    registry.deregister_op_overrides(disable_op_symbols=["aten::add.Tensor"])
    assert torch.add(x, x) is not x
    assert dump("aten::add.Tensor") == stock_add
    registry.reenable_op_overrides(enable_op_symbols="mm")
    assert mm_once(ran) == "a"


def test_deregister_by_dispatch_key_restores_the_table(three_dsls):
    ran = three_dsls
    registry.clear_overrides()
    stock = {op: dump(op) for op in ("aten::mm", "aten::add.Tensor")}
    for dsl in ("a", "b", "c"):
        registry.register_op_override(dsl, "aten", "mm", "CPU", always, tagging_impl(dsl, ran))
    registry.deregister_op_overrides(disable_dispatch_keys="CPU")
    assert dump("aten::mm") == stock["aten::mm"]
    assert mm_once(ran) is None
    registry.reenable_op_overrides(enable_dispatch_keys="CPU")
    assert mm_once(ran) == "a"


def test_filters_are_sticky_for_later_registrations():
    ran: list[str] = []
    registry.deregister_op_overrides(disable_dsl_names="late")
    info = registry.register_op_override(
        "late", "aten", "mm", "CPU", always, tagging_impl("l", ran)
    )
    assert info is not None and not info.active and not info.installed
    assert mm_once(ran) is None
    registry.reenable_op_overrides(enable_dsl_names="late")
    assert mm_once(ran) == "l"


def test_deregister_without_filters_changes_nothing(three_dsls):
    registry.deregister_op_overrides()
    assert mm_once(three_dsls) == "a"


def test_ordering_function_reorders_and_drops(three_dsls):
    ran = three_dsls
    seen_args = []

    def reverse_and_drop_c(op_symbol, dispatch_key, nodes):
        seen_args.append((op_symbol, dispatch_key, [n.dsl_name for n in nodes]))
        return [n for n in reversed(nodes) if n.dsl_name != "c"]

    registry.reorder_overrides(reverse_and_drop_c)
    assert ("mm", "CPU", ["a", "b", "c"]) in seen_args
    assert mm_once(ran) == "b"
    infos = {i.dsl: i for i in registry.list_overrides() if i.op_symbol == "mm"}
    assert infos["b"].position == 0 and infos["a"].position == 1
    assert not infos["c"].active and infos["c"].position is None
    # The function also orders later registrations.
    registry.register_op_override("d", "aten", "mm", "CPU", always, tagging_impl("d", ran))
    assert mm_once(ran) == "d"
    registry.reorder_overrides(None)
    assert mm_once(ran) == "a"


def test_ordering_function_that_fails_keeps_registration_order(three_dsls, caplog):
    def broken(op_symbol, dispatch_key, nodes):
        raise RuntimeError("broken ordering")

    with caplog.at_level(logging.WARNING, logger="torchgraft.registry"):
        registry.reorder_overrides(broken)
    assert "broken ordering" in caplog.text
    assert mm_once(three_dsls) == "a"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchgraft.registry"):
        registry.reorder_overrides(lambda op, key, nodes: "not a list")
    assert "not a list of the nodes" in caplog.text
    assert mm_once(three_dsls) == "a"
    with pytest.raises(TypeError):
        registry.reorder_overrides(42)  # type: ignore[arg-type]


@pytest.fixture
def order_module(tmp_path, monkeypatch):
    """An importable module with ordering functions, for TORCHGRAFT_OVERRIDE_ORDER_FN."""
    (tmp_path / "tg_order_fns.py").write_text(
        textwrap.dedent(
            """
            def by_dsl_descending(op_symbol, dispatch_key, nodes):
                return sorted(nodes, key=lambda n: n.dsl_name, reverse=True)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tg_order_fns"
    sys.modules.pop("tg_order_fns", None)


def test_ordering_function_from_the_environment(three_dsls, order_module, monkeypatch):
    ran = three_dsls
    monkeypatch.setenv("TORCHGRAFT_OVERRIDE_ORDER_FN", f"{order_module}.by_dsl_descending")
    registry.register_op_override("0", "aten", "mm", "CPU", always, tagging_impl("0", ran))
    assert mm_once(ran) == "c"
    # A programmatic function wins over the environment variable.
    registry.reorder_overrides(lambda op, key, nodes: nodes)
    assert mm_once(ran) == "a"


@pytest.mark.parametrize("value", ["no_such_module_xyz.fn", "os.path.no_such_fn", "noDots"])
def test_bad_ordering_environment_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("TORCHGRAFT_OVERRIDE_ORDER_FN", value)
    with pytest.raises(ValueError, match="TORCHGRAFT_OVERRIDE_ORDER_FN"):
        registry.register_op_override("a", "aten", "mm", "CPU", always, tagging_impl("a", []))
    assert registry.list_overrides() == []


def test_suspend_routers_restores_and_reinstalls(three_dsls):
    ran = three_dsls
    registry.clear_overrides()
    stock = dump("aten::mm")
    registry.register_op_override("a", "aten", "mm", "CPU", always, tagging_impl("a", ran))
    assert dump("aten::mm") != stock
    with registry.suspend_routers():
        assert dump("aten::mm") == stock
        assert mm_once(ran) is None
        assert not registry.list_overrides()[0].installed
        # Registrations inside the block wait for its end; nesting keeps routers out.
        registry.register_op_override("b", "aten", "mm", "CPU", always, tagging_impl("b", ran))
        with registry.suspend_routers():
            assert mm_once(ran) is None
        assert dump("aten::mm") == stock
        assert mm_once(ran) is None
    assert mm_once(ran) == "a"
    assert [i.installed for i in registry.list_overrides()] == [True, True]
    registry.clear_overrides()
    assert dump("aten::mm") == stock
