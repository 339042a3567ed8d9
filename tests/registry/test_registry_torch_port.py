"""PyTorch's own registry tests, run against torchgraft's API.

Adapted from pytorch/pytorch ``test/python_native/``: ``test_registry.py`` (TestRegistry,
TestRegistryRuntime, TestRegistryNonAtenNamespace), ``test_decomp.py`` and
``test_dsl_registry.py``. Each test names the torch test it adapts. torch's tests read
torch._native's private state (``_graphs``, ``_libs``, ``_filter_state``); these observe the same
behaviour through torchgraft's public API (``list_overrides``, the dispatcher, results).

Where torchgraft deliberately differs, the test asserts torchgraft's behaviour and says so;
docs/registry.md ("Differences from torch._native") lists each difference with its reason.
Not ported, because they test torch internals rather than the registry API: Dynamo's COW
guards (``test_dynamo_guards_on_cow_state`` and the other ``*_cow_state`` tests), torch's
teardown bookkeeping helpers, ``test_native_utils.py`` (torch's own cond helpers),
``test_instrumentation.py`` (torch's DSL compile logging), ``test_override_declarations.py``
(torch's own op declarations) and the per-kernel tests.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._vendor.packaging.version import Version

import torchgraft.dsl as dsl
from torchgraft import registry
from torchgraft.registry import OverrideNode, env

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("clean_overrides")]

A = torch.tensor([2.0, 3.0])
B = torch.tensor([4.0, 5.0])
STOCK_MUL = torch.tensor([8.0, 15.0])


def mul(a: torch.Tensor = A, b: torch.Tensor = B) -> torch.Tensor:
    # The overload itself: `a * b` may resolve to mul.Scalar for mixed arguments.
    return torch.ops.aten.mul.Tensor(a, b)


def dump(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def always(*args: object, **kwargs: object) -> bool:
    return True


def never(*args: object, **kwargs: object) -> bool:
    return False


def filled(value: float):
    def impl(a: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.full_like(a, value)

    return impl


# ============================================================================ test_registry.py
# ---------------------------------------------------------------------------- TestRegistry


def test_override_node_dataclass():
    """test_override_node_dataclass: same fields, order and defaults as torch's _OverrideNode."""

    def cond_fn(x):
        return True

    def impl_fn(x):
        return x

    node = OverrideNode("test_dsl", "aten", "add.Tensor", "CPU", cond_fn, impl_fn, "test_node")
    assert (node.dsl_name, node.lib_symbol, node.op_symbol, node.dispatch_key) == (
        "test_dsl",
        "aten",
        "add.Tensor",
        "CPU",
    )
    assert node.cond_fn is cond_fn and node.impl_fn is impl_fn and node.node_id == "test_node"
    assert not node.unconditional_override
    assert node.active


def test_register_op_override_basic():
    """test_register_op_override_basic: one node, with the DSL, cond and impl given."""

    def cond_fn(a, b):
        return False

    def impl_fn(a, b):
        return a

    registry.register_op_override("test_backend", "aten", "add.Tensor", "CPU", cond_fn, impl_fn)
    (info,) = registry.list_overrides()
    assert (info.dsl, info.op, info.dispatch_key) == ("test_backend", "aten::add.Tensor", "CPU")
    assert info.cond is not None and info.cond.endswith("cond_fn")
    assert info.impl.endswith("impl_fn")
    # The node objects themselves, as an ordering function sees them.
    seen: list[OverrideNode] = []
    registry.reorder_overrides(lambda op, key, nodes: seen.extend(nodes) or nodes)
    assert [(n.cond_fn, n.impl_fn) for n in seen] == [(cond_fn, impl_fn)]


def test_deregister_op_overrides_basic():
    """test_deregister_op_overrides_basic."""
    registry.register_op_override("test_backend", "aten", "mul.Tensor", "CPU", never, filled(0))
    assert registry.list_overrides()[0].active
    registry.deregister_op_overrides(disable_dsl_names="test_backend")
    assert not registry.list_overrides()[0].active


def _order(op: str = "aten::mul.Tensor") -> list[str]:
    infos = [i for i in registry.list_overrides() if i.op == op and i.position is not None]
    return [i.dsl for i in sorted(infos, key=lambda i: i.position)]


def alphabetical(op_symbol: str, dispatch_key: str, nodes: list) -> list:
    return sorted(nodes, key=lambda n: n.dsl_name)


def test_reorder_graphs_from_user_function_basic():
    """test_reorder_graphs_from_user_function_basic (torchgraft's name: reorder_overrides)."""
    for name in ("dsl_c", "dsl_a", "dsl_b"):
        registry.register_op_override(name, "aten", "mul.Tensor", "CPU", never, filled(0))
    assert _order() == ["dsl_c", "dsl_a", "dsl_b"]
    registry.reorder_overrides(alphabetical)
    assert _order() == ["dsl_a", "dsl_b", "dsl_c"]


def test_reorder_graphs_from_user_function_error_handling(caplog):
    """test_reorder_graphs_from_user_function_error_handling: one warning, order kept."""
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", never, filled(0))

    def failing_order_fn(op_symbol, dispatch_key, nodes):
        raise ValueError("Test exception")

    with caplog.at_level(logging.WARNING, logger="torchgraft.registry"):
        registry.reorder_overrides(failing_order_fn)
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1
    assert "Graph transformation failed" in records[0].getMessage()
    assert _order() == ["test_dsl"]


def test_get_user_ordering_fn_env_var_not_set(monkeypatch):
    """test_get_user_ordering_fn_env_var_not_set (torchgraft's variable:
    TORCHGRAFT_OVERRIDE_ORDER_FN)."""
    monkeypatch.delenv(env.ORDER_FN_ENV, raising=False)
    assert env.env_order_fn() is None


def test_get_user_ordering_fn_invalid_path(monkeypatch):
    """test_get_user_ordering_fn_invalid_path: "Could not resolve"."""
    monkeypatch.setenv(env.ORDER_FN_ENV, "nonexistent.module.function")
    with pytest.raises(ValueError, match="Could not resolve"):
        env.env_order_fn()
    with pytest.raises(ValueError, match="Could not resolve"):
        registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", never, filled(0))


def test_integration_reorder_and_register():
    """test_integration_reorder_and_register."""
    registry.register_op_override("backend_z", "aten", "mul.Tensor", "CPU", never, filled(1))
    registry.register_op_override("backend_a", "aten", "mul.Tensor", "CPU", never, filled(2))
    assert _order() == ["backend_z", "backend_a"]
    registry.reorder_overrides(alphabetical)
    assert _order() == ["backend_a", "backend_z"]


@pytest.mark.parametrize(
    "bad_key", ["Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd"]
)
def test_disallowed_dispatch_key_rejected(bad_key):
    """test_disallowed_dispatch_key_rejected."""
    with pytest.raises(ValueError, match="dispatch_key="):
        registry.register_op_override("test_dsl", "aten", "mul.Tensor", bad_key, always, filled(0))


def test_lib_symbol_off_the_allowlist_rejected():
    """test_lib_symbol_off_the_allowlist_rejected (and torch 2.13's "Unsupported lib_symbol")."""
    assert "_native" not in registry.ALLOWED_LIB_SYMBOLS
    for lib in ("_native", "torchgraft_overrides", "prims"):
        with pytest.raises(ValueError, match="is not overridable") as info:
            registry.register_op_override("test_dsl", lib, "some_op", "CPU", always, filled(0))
        assert "Unsupported lib_symbol" in str(info.value)


def test_cond_none_without_unconditional_override_rejected():
    """test_cond_none_without_unconditional_override_rejected."""
    with pytest.raises(ValueError, match="cond must be provided"):
        registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", None, filled(0))


# ---------------------------------------------------------------------------- TestRegistryRuntime


def test_teardown_restores_the_fallback_of_a_replaced_override():
    """test_teardown_restores_the_fallback_of_a_replaced_override: a second override of the same
    DSL at the same key goes in front (torch accepts it, so does torchgraft); removing it leaves
    exactly the first, whose fallback is ATen again, never the removed one."""
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", never, filled(11.0))
    assert torch.equal(mul(), STOCK_MUL)
    second = registry.register_op_override(
        "test_dsl", "aten", "mul.Tensor", "CPU", always, filled(99.0)
    )
    assert second is not None
    assert torch.equal(mul(), torch.tensor([99.0, 99.0]))
    assert registry.remove_override(second)
    assert torch.equal(mul(), STOCK_MUL)


def test_cond_false_falls_through_to_native():
    """test_cond_false_falls_through_to_native."""
    called = []
    registry.register_op_override(
        "test_dsl", "aten", "mul.Tensor", "CPU", never, lambda a, b: called.append(1) or a
    )
    assert torch.equal(mul(), STOCK_MUL)
    assert called == []


@pytest.mark.skipif(
    not hasattr(torch.compiler, "_compile_session_context"),
    reason=f"torch {torch.__version__} has no torch.compiler._compile_session_context",
)
def test_compile_session_flag_falls_through_without_recursion():
    """test_compile_session_flag_falls_through_without_recursion."""

    def impl(a, b):
        raise AssertionError("impl should not be called when cond=False")

    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", never, impl)
    with torch.compiler._compile_session_context():
        assert torch.equal(mul(), STOCK_MUL)


def test_folded_dynamo_flag_on_real_tensors_does_not_recurse(monkeypatch):
    """test_folded_dynamo_flag_on_real_tensors_does_not_recurse and
    test_dynamo_shortcut_still_fires_for_outer_call: with is_dynamo_compiling() folded to True
    on real tensors, the router runs its eager path once (torchgraft has no Dynamo shortcut in
    the router: compiled graphs reach overrides through native_decomp_table())."""
    cond_calls = []

    def cond(a, b):
        cond_calls.append(1)
        return False

    def impl(a, b):
        raise AssertionError("impl should not be called when cond=False")

    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", cond, impl)
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    assert torch.equal(mul(), STOCK_MUL)
    assert cond_calls == [1]


def test_dynamo_shortcut_preserves_cow_fallback():
    """test_dynamo_shortcut_preserves_cow_fallback: copy-on-write inputs of a compiled function
    reach the cond and the fallback, and stay copy-on-write."""
    cond_calls = []

    def cond(a, b):
        cond_calls.append(1)
        return False

    def impl(a, b):
        raise AssertionError("impl should not be called when cond=False")

    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", cond, impl)
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def fn(a, b):
        return torch.mul(a, b)

    a, b = torch._lazy_clone(A), torch._lazy_clone(B)
    assert torch._C._is_cow_tensor(a) and torch._C._is_cow_tensor(b)
    try:
        assert torch.equal(fn(a, b), STOCK_MUL)
    finally:
        torch._dynamo.reset()
    assert cond_calls
    assert torch._C._is_cow_tensor(a) and torch._C._is_cow_tensor(b)


class _CowStateWrapperTensor(torch.Tensor):
    """A wrapper subclass (Python dispatch key), as in torch's test."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _CowStateWrapperTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), dtype=elem.dtype, device=elem.device, strides=elem.stride()
        )
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError("unexpected dispatch")


def test_is_cow_tensor_rejects_python_tensor_subclasses():
    """test_is_cow_tensor_rejects_python_tensor_subclasses: torch 2.15 raises for these; the
    Triton RMSNorm cond's COW check must still answer (False: no storage to materialize)."""
    from torchgraft.grafts.rms_norm.triton_cond import _is_cow

    x = _CowStateWrapperTensor(torch.tensor([2.0, 3.0]))
    assert _is_cow(x) is False
    assert _is_cow(torch.tensor([1.0])) is False
    assert _is_cow(torch._lazy_clone(torch.tensor([1.0]))) is True


def test_cond_true_routes_to_impl():
    """test_cond_true_routes_to_impl."""
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", always, filled(42.0))
    assert torch.equal(mul(), torch.tensor([42.0, 42.0]))


def test_no_recursion_in_aten_backward_formula():
    """test_no_recursion_in_aten_backward_formula: bmm's backward calls bmm; the fallback must
    not re-enter the router."""

    def impl(a, b):
        raise AssertionError("impl should not be called when cond=False")

    registry.register_op_override("test_dsl", "aten", "bmm", "CPU", never, impl)
    a = torch.randn(2, 3, 4, requires_grad=True)
    b = torch.randn(2, 4, 5, requires_grad=True)
    expected = (a.detach().double()[..., None] * b.detach().double()[:, None]).sum(2)
    out = torch.bmm(a, b)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert (a.grad != 0).any() and (b.grad != 0).any()


def test_deregister_reenable_roundtrip():
    """test_deregister_reenable_roundtrip: deregister takes the router out, reenable puts it
    back."""
    stock = dump("aten::mul.Tensor")
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", always, filled(7.0))
    assert torch.equal(mul(), torch.tensor([7.0, 7.0]))
    assert registry.list_overrides()[0].installed
    registry.deregister_op_overrides(disable_dsl_names="test_dsl")
    assert torch.equal(mul(), STOCK_MUL)
    assert not registry.list_overrides()[0].installed
    assert dump("aten::mul.Tensor") == stock
    registry.reenable_op_overrides(enable_dsl_names="test_dsl")
    assert torch.equal(mul(), torch.tensor([7.0, 7.0]))
    assert registry.list_overrides()[0].installed


def test_empty_graph_tears_down_router():
    """test_empty_graph_tears_down_router: an ordering that keeps nothing removes the router."""
    stock = dump("aten::mul.Tensor")
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", always, filled(99.0))
    assert torch.equal(mul(), torch.tensor([99.0, 99.0]))
    registry.reorder_overrides(lambda op, key, nodes: [])
    assert dump("aten::mul.Tensor") == stock
    assert torch.equal(mul(), STOCK_MUL)


def test_fake_tensor_shape_inference():
    """test_fake_tensor_shape_inference."""
    registry.register_op_override("test_dsl", "aten", "mul.Tensor", "CPU", always, filled(1.0))
    with FakeTensorMode():
        out = torch.ops.aten.mul.Tensor(torch.empty(3, 4), torch.empty(3, 4))
    assert out.shape == torch.Size([3, 4]) and out.dtype == torch.float32


def test_unconditional_override_cond_none():
    """test_unconditional_override_cond_none."""
    calls = []

    def impl(a, b):
        calls.append(1)
        return torch.full_like(a, 5.0)

    registry.register_op_override(
        "test_dsl", "aten", "mul.Tensor", "CPU", None, impl, unconditional_override=True
    )
    assert torch.equal(mul(), torch.tensor([5.0, 5.0]))
    assert torch.equal(mul(torch.tensor([0.0]), torch.tensor([0.0])), torch.tensor([5.0]))
    assert calls == [1, 1]


def test_unconditional_override_survives_disable():
    """test_unconditional_override_survives_disable -- DELIBERATE DIFFERENCE: in torch 2.15 an
    unconditional override is exempt from deregister_op_overrides; in torchgraft every override
    is a faster route to the op's own answer, so deregistering it gives stock PyTorch back (as
    torch 2.11-2.14 did; torch's private _unconditional_masked hatch is not needed)."""
    registry.register_op_override(
        "test_dsl", "aten", "mul.Tensor", "CPU", None, filled(5.0), unconditional_override=True
    )
    assert torch.equal(mul(), torch.tensor([5.0, 5.0]))
    registry.deregister_op_overrides(disable_dsl_names="test_dsl")
    assert torch.equal(mul(), STOCK_MUL)
    registry.reenable_op_overrides(enable_dsl_names="test_dsl")
    assert torch.equal(mul(), torch.tensor([5.0, 5.0]))


# ------------------------------------------------------------- TestRegistryNonAtenNamespace

NS = "_tg_registry_test"
NS2 = "_tg_registry_test2"
MISSING_NS = "_tg_registry_missing_ns"


@pytest.fixture
def namespaces(monkeypatch):
    """Two throwaway namespaces defining ``twice`` with only a composite kernel (the shape of a
    torch.library.custom_op), allowlisted for the test."""
    monkeypatch.setattr(
        registry, "ALLOWED_LIB_SYMBOLS", registry.ALLOWED_LIB_SYMBOLS | {NS, NS2, MISSING_NS}
    )
    libs = []
    for ns, factor in ((NS, 2), (NS2, 3)):
        lib = torch.library.Library(ns, "DEF")
        lib.define("twice(Tensor self) -> Tensor")
        lib.impl("twice", lambda x, f=factor: x * f, "CompositeExplicitAutograd")
        libs.append(lib)
    yield getattr(torch.ops, NS).twice.default, getattr(torch.ops, NS2).twice.default
    registry.clear_overrides()
    for lib in libs:
        lib._destroy()


def _register_ns(cond, impl, lib_symbol=NS):
    return registry.register_op_override("test_dsl", lib_symbol, "twice", "CPU", cond, impl)


def test_graph_key_and_node_carry_the_namespace(namespaces):
    """test_graph_key_and_node_carry_the_namespace."""
    _register_ns(always, lambda x: x.clone())
    (info,) = registry.list_overrides()
    assert info.lib_symbol == NS and info.op == f"{NS}::twice"
    assert info.stats_key == f"test_dsl/{NS}::twice/CPU"


def test_namespace_cond_true_routes_to_impl(namespaces):
    """TestRegistryNonAtenNamespace.test_cond_true_routes_to_impl."""
    op, _ = namespaces
    _register_ns(always, filled(99.0))
    assert torch.equal(op(torch.tensor([1.0, 2.0])), torch.tensor([99.0, 99.0]))


def test_cond_false_falls_back_to_composite_kernel(namespaces):
    """test_cond_false_falls_back_to_composite_kernel."""
    op, _ = namespaces

    def impl(x):
        raise AssertionError("impl must not run when cond is False")

    _register_ns(never, impl)
    assert torch.equal(op(torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))


def test_teardown_restores_the_original_kernel(namespaces):
    """test_teardown_restores_the_original_kernel."""
    op, _ = namespaces
    info = _register_ns(always, filled(99.0))
    assert torch.equal(op(torch.tensor([1.0])), torch.tensor([99.0]))
    assert registry.remove_override(info)
    assert torch.equal(op(torch.tensor([1.0])), torch.tensor([2.0]))


def test_teardown_leaves_no_decomposition_router(namespaces):
    """test_teardown_leaves_no_decomposition_router."""
    op, _ = namespaces
    info = _register_ns(always, filled(99.0))
    assert op in registry.native_decomp_table(overrides_only=True)
    registry.remove_override(info)
    assert op not in registry.native_decomp_table(overrides_only=True)


def test_same_op_symbol_in_two_namespaces_is_independent(namespaces):
    """test_same_op_symbol_in_two_namespaces_is_independent."""
    op, op2 = namespaces
    _register_ns(always, filled(99.0))
    _register_ns(always, filled(7.0), lib_symbol=NS2)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(op(x), torch.full_like(x, 99.0))
    assert torch.equal(op2(x), torch.full_like(x, 7.0))


def test_op_symbol_filters_are_namespace_blind(namespaces):
    """test_op_symbol_filters_are_namespace_blind: a bare symbol matches in every namespace, a
    "ns::op" string matches nothing."""
    op, op2 = namespaces
    _register_ns(always, filled(99.0))
    _register_ns(always, filled(7.0), lib_symbol=NS2)
    x = torch.tensor([1.0, 2.0])
    registry.deregister_op_overrides(disable_op_symbols=[f"{NS}::twice"])
    assert torch.equal(op(x), torch.full_like(x, 99.0))
    assert torch.equal(op2(x), torch.full_like(x, 7.0))
    registry.deregister_op_overrides(disable_op_symbols=["twice"])
    assert torch.equal(op(x), x * 2) and torch.equal(op2(x), x * 3)
    registry.reenable_op_overrides(enable_op_symbols=["twice"])
    assert torch.equal(op(x), torch.full_like(x, 99.0))
    assert torch.equal(op2(x), torch.full_like(x, 7.0))


def test_get_dsl_operations_reports_one_namespace(namespaces):
    """test_get_dsl_operations_reports_one_namespace."""
    _register_ns(always, lambda x: x.clone())
    assert registry.get_dsl_operations("test_dsl", lib_symbol=NS) == ["twice"]
    assert "twice" not in registry.get_dsl_operations("test_dsl")


def test_undefined_op_raises_on_install(namespaces):
    """test_undefined_op_raises_on_install -- DELIBERATE DIFFERENCE: torch raises when the op does
    not resolve; torchgraft keeps the override, inactive, with a warning, so code written for a
    newer torch (whose ops this torch lacks) still imports."""
    with pytest.warns(UserWarning, match=re.escape(f"{MISSING_NS}::twice does not exist")):
        info = _register_ns(always, lambda x: x, lib_symbol=MISSING_NS)
    assert info is not None and not info.active and not info.op_available
    # An op defined later (torch_nn's ops appear when their module is imported) is picked up
    # by the next change to the registry.
    lib = torch.library.Library(MISSING_NS, "DEF")
    try:
        lib.define("twice(Tensor self) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
        registry.reenable_op_overrides()
        (listed,) = registry.list_overrides()
        assert listed.active and listed.op_available and listed.installed
        x = torch.tensor([1.0, 2.0])
        assert torch.equal(getattr(torch.ops, MISSING_NS).twice(x), x)
    finally:
        registry.clear_overrides()
        lib._destroy()


# ============================================================================ test_decomp.py


def _export_add(cond, impl):
    registry.register_op_override("test_decomp", "aten", "add.Tensor", "CPU", cond, impl)

    class M(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    ep = torch.export.export(M(), (torch.randn(3), torch.randn(3)))
    return ep.run_decompositions(registry.native_decomp_table())


def _targets(ep) -> list[str]:
    return [str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"]


def test_table_default_includes_core_aten_and_overrides():
    """test_table_default_includes_core_aten_and_overrides."""
    registry.register_op_override("test_decomp", "aten", "add.Tensor", "CPU", never, filled(1))
    table = registry.native_decomp_table()
    assert torch.ops.aten.add.Tensor in table
    assert len(table) > 100


def test_table_override_wins_on_conflict():
    """test_table_override_wins_on_conflict."""
    registry.register_op_override("test_decomp", "aten", "add.Tensor", "CPU", never, filled(99))
    table = registry.native_decomp_table()
    only = registry.native_decomp_table(overrides_only=True)
    assert table[torch.ops.aten.add.Tensor] is only[torch.ops.aten.add.Tensor]


def test_table_overrides_only():
    """test_table_overrides_only."""
    registry.register_op_override("test_decomp", "aten", "add.Tensor", "CPU", never, filled(1))
    registry.register_op_override("test_decomp", "aten", "mul.Tensor", "CPU", never, filled(2))
    table = registry.native_decomp_table(overrides_only=True)
    assert set(table) == {torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor}


def test_deregister_removes_and_reenable_restores_decomp_entry():
    """test_deregister_removes_decomp_entry and test_reenable_restores_decomp_entry."""
    registry.register_op_override("test_decomp", "aten", "add.Tensor", "CPU", never, filled(1))
    assert torch.ops.aten.add.Tensor in registry.native_decomp_table(overrides_only=True)
    registry.deregister_op_overrides(disable_dsl_names="test_decomp")
    assert torch.ops.aten.add.Tensor not in registry.native_decomp_table(overrides_only=True)
    registry.reenable_op_overrides(enable_dsl_names="test_decomp")
    assert torch.ops.aten.add.Tensor in registry.native_decomp_table(overrides_only=True)


def test_export_with_matching_cond_routes_to_native():
    """test_export_with_matching_cond_routes_to_native (the opaque op's namespace here is
    torchgraft_overrides, torch's is _native)."""
    ep = _export_add(always, filled(7))
    assert any("torchgraft_overrides" in t for t in _targets(ep)), ep.graph_module.code


def test_export_with_non_matching_cond_preserves_aten():
    """test_export_with_non_matching_cond_preserves_aten."""
    ep = _export_add(never, filled(-1))
    assert not any("torchgraft_overrides" in t for t in _targets(ep))
    assert any("aten.add.Tensor" in t for t in _targets(ep))


def test_export_cond_exception_treated_as_non_match():
    """test_export_cond_exception_treated_as_non_match."""

    def raising_cond(*a, **kw):
        raise RuntimeError("intentional failure under tracing")

    ep = _export_add(raising_cond, filled(-1))
    assert not any("torchgraft_overrides" in t for t in _targets(ep))


# ============================================================================ test_dsl_registry.py
# torch's DSLRegistry (register_dsl, list_all_dsls, ...) has no torchgraft counterpart by
# design: torchgraft's DSL table is fixed (torchgraft.dsl.DSLS) and any DSL name can be used
# with register_op_override. The protocol and real-DSL tests port directly.


@pytest.mark.parametrize("name", sorted(dsl.DSLS))
def test_dsl_protocol_interface(name):
    """test_dsl_protocol_interface."""
    module = dsl.DSLS[name]
    for method in (
        "runtime_available",
        "runtime_version",
        "deregister_op_overrides",
        "register_op_override",
    ):
        assert callable(getattr(module, method)), f"DSL {name!r} lacks {method}"


@pytest.mark.parametrize("name", ["triton", "cutedsl"])
def test_real_dsl_integration(name):
    """test_real_dsl_integration: availability is a bool, the version a Version or None, and an
    available DSL has a version."""
    module = dsl.DSLS[name]
    available = module.runtime_available()
    version = module.runtime_version()
    assert isinstance(available, bool)
    assert version is None or isinstance(version, Version)
    assert (version is not None) == available
    assert dsl.dsl_versions()[name] == (str(version) if version is not None else None)
