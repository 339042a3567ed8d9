"""torchgraft.functional.swiglu / geglu: values, gradients, layouts, errors, compile (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err, rel_err_in
from torchgraft import functional as tgf
from torchgraft import stats
from torchgraft.ops.glu.reference import geglu_reference, swiglu_reference

# Relative-norm tolerances against the float64 reference: one rounding of the output.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = list(TOL)
OPS = [
    ("swiglu", lambda g, u: tgf.swiglu(g, u), swiglu_reference),
    ("geglu", lambda g, u: tgf.geglu(g, u), lambda g, u: geglu_reference(g, u, "none")),
    (
        "geglu_tanh",
        lambda g, u: tgf.geglu(g, u, approximate="tanh"),
        lambda g, u: geglu_reference(g, u, "tanh"),
    ),
]


def _inputs(shape, dtype, requires_grad=False):
    gate = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype).requires_grad_(requires_grad)
    up = torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 13), (64, 1000), (0, 8)])
@pytest.mark.parametrize(("name", "op", "ref"), OPS, ids=[o[0] for o in OPS])
def test_forward_and_backward_match_float64(name, op, ref, shape, dtype):
    gate, up = _inputs(shape, dtype, requires_grad=True)
    y = op(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    y64 = ref(g64, u64)
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    y.backward(dy)
    y64.backward(dy.double())
    if y.numel() == 0:
        assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
        return
    assert rel_err_in(y, y64) < TOL[dtype]
    # The gradients are rounded once from products of rounded inputs: two roundings.
    assert rel_err_in(gate.grad, g64.grad) < 2 * TOL[dtype]
    assert rel_err_in(up.grad, u64.grad) < 2 * TOL[dtype]


@pytest.mark.parametrize(("name", "op", "ref"), OPS, ids=[o[0] for o in OPS])
def test_gradcheck_float64(name, op, ref):
    gate, up = _inputs((4, 9), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op, (gate, up))


def test_matches_the_eager_composites_in_float32():
    gate, up = _inputs((33, 17), torch.float32)
    assert rel_err(tgf.swiglu(gate, up), F.silu(gate) * up) < 1e-6
    assert rel_err(tgf.geglu(gate, up), F.gelu(gate) * up) < 1e-6
    assert rel_err(tgf.geglu(gate, up, "tanh"), F.gelu(gate, approximate="tanh") * up) < 1e-6


def test_non_contiguous_inputs():
    base_g, base_u = _inputs((16, 24), torch.float32)
    gate, up = base_g.t(), base_u[:, ::2].repeat(1, 2).t()
    assert not gate.is_contiguous() and not up.is_contiguous()
    assert rel_err(tgf.swiglu(gate, up), swiglu_reference(gate, up)) < TOL[torch.float32]


def test_runs_the_native_cpu_kernels():
    from torchgraft import reset_stats

    reset_stats()
    gate, up = _inputs((8, 8), torch.bfloat16, requires_grad=True)
    tgf.swiglu(gate, up).sum().backward()
    got = stats()
    assert got["native/torchgraft::swiglu/CPU"]["calls"] == 1
    assert got["native/torchgraft::swiglu_backward/CPU"]["calls"] == 1


def test_bad_inputs_raise_like_eager():
    gate, up = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="expected up of size"):
        tgf.swiglu(gate, up[:, :4])
    with pytest.raises(RuntimeError, match="expected up to have dtype"):
        tgf.swiglu(gate, up.double())
    with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
        tgf.swiglu(gate.long(), up.long())
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        tgf.geglu(gate, up, approximate="erf")


def test_opcheck():
    gate, up = _inputs((5, 6), torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.torchgraft.swiglu, (gate, up))
    torch.library.opcheck(torch.ops.torchgraft.geglu, (gate, up, True))
    grad = torch.randn(5, 6)
    torch.library.opcheck(torch.ops.torchgraft.swiglu_backward, (grad, gate.detach(), up.detach()))


def test_compiles_fullgraph_without_graph_breaks():
    def mlp(gate, up):
        return tgf.swiglu(gate, up).sum() + tgf.geglu(gate, up, "tanh").sum()

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    gate, up = _inputs((6, 10), torch.float32, requires_grad=True)
    out = compiled(gate, up)
    out.backward()
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    ref = mlp(g2, u2)
    ref.backward()
    assert torch.allclose(out, ref) and torch.allclose(gate.grad, g2.grad)
    assert torch.allclose(up.grad, u2.grad)
