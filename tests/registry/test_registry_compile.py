"""torch.compile and torch.export: no graph breaks, and native_decomp_table() opts overrides in."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from conftest import rel_err
from torchgraft import registry

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def ref_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double()[:, :, None] * b.double()[None, :, :]).sum(1)


class MMOverride:
    """An mm override for 8-row inputs that counts its runs (no aten::mm inside)."""

    def __init__(self) -> None:
        self.calls = 0

    @staticmethod
    def cond(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape[0] == 8

    def impl(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return ref_mm(a, b).to(a.dtype)


def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.mm(x, w)) + 1


def graph_capturing_backend(decompositions: dict | None):
    """An AOTAutograd backend that keeps every graph it compiles (forward and backward)."""
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=compiler, bw_compiler=compiler, decompositions=decompositions
    )
    return backend, graphs


def targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.compat
def test_dynamo_traces_an_overridden_op_without_graph_breaks():
    override = MMOverride()
    registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    explanation = torch._dynamo.explain(model)(x, w)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    ref = torch.relu(ref_mm(x, w)) + 1
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    override.calls = 0
    assert rel_err(compiled(x, w), ref) < 1e-6
    # Without the table the graph holds aten.mm, and the eager router takes it at run time.
    assert override.calls == 1


@pytest.mark.compat
def test_decomp_table_puts_the_override_in_the_compiled_graph():
    override = MMOverride()
    info = registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    assert info is not None
    backend, graphs = graph_capturing_backend(registry.native_decomp_table())
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    ref = torch.relu(ref_mm(x, w)) + 1
    out = compiled(x, w)
    assert rel_err(out, ref) < 1e-6
    (graph,) = graphs
    assert f"torchgraft_overrides.{info.node_id}.default" in targets(graph)
    assert "aten.mm.default" not in targets(graph)
    assert override.calls == 1
    compiled(x, w)
    assert override.calls == 2
    # The counter is the override's own: torchgraft.stats() sees compiled calls too.
    assert registry.override_stats()["test/aten::mm/CPU"]["calls"] == 2


def test_decomp_table_leaves_unmatched_calls_to_aten():
    override = MMOverride()
    registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    backend, graphs = graph_capturing_backend(registry.native_decomp_table(overrides_only=True))
    x, w = torch.randn(5, 4), torch.randn(4, 3)  # 5 rows: cond says no
    out = torch.compile(model, backend=backend, fullgraph=True)(x, w)
    assert rel_err(out, torch.relu(ref_mm(x, w)) + 1) < 1e-6
    assert "aten.mm.default" in targets(graphs[0])
    assert not any("torchgraft_overrides" in t for t in targets(graphs[0]))


@pytest.mark.compat
def test_compiled_training_step_uses_the_override_forward_and_backward():
    override = MMOverride()
    registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    backend, graphs = graph_capturing_backend(registry.native_decomp_table())
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(x, w).sum().backward()
    # Reference gradients from the stock ops.
    registry.clear_overrides()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    model(x2, w2).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-12
    assert rel_err(w.grad, w2.grad) < 1e-12
    forward, backward = graphs
    assert any("torchgraft_overrides" in t for t in targets(forward))
    # grad_x = grad @ w.T has 8 rows -> overridden; grad_w = x.T @ grad has 4 -> aten.
    assert any("torchgraft_overrides" in t for t in targets(backward))
    assert "aten.mm.default" in targets(backward)
    assert override.calls == 2


def test_cond_exceptions_count_as_no_match_when_tracing():
    def cond(a, b):
        if isinstance(a, torch._subclasses.FakeTensor):
            raise RuntimeError("undefined on fake tensors")
        return True

    calls = []
    registry.register_op_override(
        "test", "aten", "mm", "CPU", cond, lambda a, b: calls.append(1) or ref_mm(a, b).float()
    )
    backend, graphs = graph_capturing_backend(registry.native_decomp_table(overrides_only=True))
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    torch.compile(model, backend=backend, fullgraph=True)(x, w)
    assert "aten.mm.default" in targets(graphs[0])


@pytest.mark.compat
def test_export_run_decompositions_puts_the_override_in_the_exported_graph():
    override = MMOverride()
    info = registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    assert info is not None

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, self.w).relu()

    m = Model()
    x = torch.randn(8, 4)
    exported = torch.export.export(m, (x,))
    override.calls = 0
    decomposed = exported.run_decompositions(registry.native_decomp_table())
    assert f"torchgraft_overrides.{info.node_id}.default" in targets(decomposed.graph_module)
    assert override.calls == 0  # tracing only emits the opaque op
    out = decomposed.module()(x)
    assert override.calls == 1
    assert rel_err(out, ref_mm(x, m.w.detach()).relu()) < 1e-6


def test_seed_form_override_in_a_compiled_graph():
    """An older-form impl (keyset first, decides itself) also runs inside compiled graphs."""
    seen = []

    def impl(keyset, a, b):
        seen.append(type(keyset).__name__)
        if a.shape[0] < 8:
            return torch.ops.aten.mm.default(a, b)  # re-enters: reaches ATen's kernel
        return ref_mm(a, b).to(a.dtype)

    registry.register_op_override("test", "aten", "mm", "CPU", None, impl, with_keyset=True)
    backend, graphs = graph_capturing_backend(registry.native_decomp_table())
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    small_x, w = torch.randn(3, 4), torch.randn(4, 3)
    stock_small = model(small_x, w)  # eager, through the router: ATen via re-entrancy
    assert torch.equal(compiled(small_x, w), stock_small)
    assert any("torchgraft_overrides" in t for t in targets(graphs[0]))
    assert seen == ["DispatchKeySet", "DispatchKeySet"]


@pytest.mark.slow
def test_inductor_with_the_decomp_table():
    from torch._inductor.compile_fx import compile_fx

    override = MMOverride()
    registry.register_op_override("test", "aten", "mm", "CPU", override.cond, override.impl)
    table = registry.native_decomp_table()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        return compile_fx(gm, example_inputs, decompositions=table)

    x, w = torch.randn(8, 4), torch.randn(4, 3)
    # AOTAutograd's cache keys on the graph before decomposition, not on the table: a graph
    # compiled in another process with other overrides would be reused (see docs/registry.md).
    with torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(model, backend=backend, fullgraph=True)(x, w)
    assert override.calls == 1
    assert rel_err(out, torch.relu(ref_mm(x, w)) + 1) < 1e-6
