"""torchgraft.functional.swiglu / geglu: values, gradients, layouts, errors, compile (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err, rel_err_in
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.glu.reference import geglu_reference, swiglu_reference

pytestmark = pytest.mark.default_torch

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
    tol = TOL[dtype]
    if dtype == torch.float64 and name == "geglu":
        # Exact GELU is x/2 * (1 + erf(x/sqrt 2)) in the kernel and in the float64 reference
        # alike: for x near -5, 1 + erf is ~1e-6, so one ulp of erf is ~1e-10 of the result (a
        # lone element shows it; larger shapes average it away).
        tol = 1e-9
    assert rel_err_in(y, y64) < tol
    # The gradients are rounded once from products of rounded inputs: two roundings.
    assert rel_err_in(gate.grad, g64.grad) < 2 * tol
    assert rel_err_in(up.grad, u64.grad) < 2 * tol


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
    reset_stats()
    gate, up = _inputs((8, 8), torch.bfloat16, requires_grad=True)
    tgf.swiglu(gate, up).sum().backward()
    got = stats()
    assert got["native/torchgraft::swiglu/CPU"]["calls"] == 1
    assert got["native/torchgraft::swiglu_backward/CPU"]["calls"] == 1


def test_calls_the_kernels_do_not_take_run_the_eager_expression():
    gate, up = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="must match the size of tensor"):
        tgf.swiglu(gate, up[:, :4])
    torch.testing.assert_close(tgf.swiglu(gate, up.double()), F.silu(gate) * up.double())
    torch.testing.assert_close(tgf.swiglu(gate, up[:1]), F.silu(gate) * up[:1])
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        tgf.swiglu(gate.long(), up.long())
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        tgf.geglu(gate.long(), up.long())
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        tgf.geglu(gate, up, approximate="erf")


def test_the_ops_refuse_what_their_kernels_do_not_take():
    gate, up = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match=r"swiglu: expected up of size \[4, 8\], got \[4, 4\]"):
        torch.ops.torchgraft.swiglu(gate, up[:, :4])
    with pytest.raises(RuntimeError, match="swiglu: expected up to have dtype Float, got Double"):
        torch.ops.torchgraft.swiglu(gate, up.double())
    with pytest.raises(RuntimeError, match="\"geglu\" not implemented for 'Long'"):
        torch.ops.torchgraft.geglu(gate.long(), up.long(), False)


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


def _mlp_inputs(dtype=torch.float32):
    """gate and up as an MLP makes them: fresh projections of one input."""
    x = torch.randn(6, 16, dtype=torch.float64).to(dtype).requires_grad_()
    w_gate = torch.randn(16, 24, dtype=torch.float64).to(dtype).requires_grad_()
    w_up = torch.randn(16, 24, dtype=torch.float64).to(dtype).requires_grad_()
    return x, w_gate, w_up


INPLACE_OPS = [
    ("swiglu", lambda g, u, inplace: tgf.swiglu(g, u, inplace_backward=inplace)),
    ("geglu", lambda g, u, inplace: tgf.geglu(g, u, inplace_backward=inplace)),
    ("geglu_tanh", lambda g, u, inplace: tgf.geglu(g, u, "tanh", inplace_backward=inplace)),
]


@pytest.mark.parametrize(("name", "op"), INPLACE_OPS, ids=[o[0] for o in INPLACE_OPS])
def test_inplace_backward_gives_the_same_gradients(name, op):
    x, w_gate, w_up = _mlp_inputs()
    dy = torch.randn(6, 24)
    grads = []
    for inplace in (False, True):
        op(x @ w_gate, x @ w_up, inplace).backward(dy)
        grads.append([t.grad.clone() for t in (x, w_gate, w_up)])
        for t in (x, w_gate, w_up):
            t.grad = None
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_inplace_backward_writes_over_gate_and_up():
    reset_stats()
    x, w_gate, w_up = _mlp_inputs()
    gate, up = x @ w_gate, x @ w_up
    gate_before, up_before = gate.detach().clone(), up.detach().clone()
    dy = torch.randn(gate.shape)
    dgate_ref, dup_ref = torch.ops.torchgraft.swiglu_backward(dy, gate_before, up_before)
    captured: dict[str, torch.Tensor] = {}
    gate.register_hook(lambda g: captured.setdefault("gate", g))
    tgf.swiglu(gate, up, inplace_backward=True).backward(dy)
    # The gradient flowing to the gate projection is gate's own memory, holding dgate.
    assert captured["gate"].data_ptr() == gate.data_ptr()
    assert torch.equal(gate.detach(), dgate_ref) and torch.equal(up.detach(), dup_ref)
    assert stats()["native/torchgraft::swiglu_backward_/CPU"]["calls"] == 1


def test_inplace_backward_is_refused_where_it_would_be_wrong():
    # A recorded op that saved gate and runs its backward after ours: a version-counter error,
    # not gradients computed from overwritten values.
    x, w_gate, w_up = _mlp_inputs()
    gate, up = x @ w_gate, x @ w_up
    other = (gate * up).sum()
    y = tgf.swiglu(gate, up, inplace_backward=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # Leaves keep their values and get ordinary gradients.
    gate, up = _inputs((4, 8), torch.float32, requires_grad=True)
    gate_before = gate.detach().clone()
    tgf.swiglu(gate, up, inplace_backward=True).sum().backward()
    assert torch.equal(gate.detach(), gate_before) and gate.grad.data_ptr() != gate.data_ptr()


def test_inplace_backward_op_rejects_overlapping_outputs():
    gate, _ = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="gate and up are both written to"):
        torch.ops.torchgraft.swiglu_backward_(torch.randn(4, 8), gate, gate)
    with pytest.raises(RuntimeError, match="gate and up are both written to"):
        torch.ops.torchgraft.swiglu_backward_(torch.randn(2, 8), gate[:2], gate[1:3])
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.ops.torchgraft.swiglu_backward_(torch.randn(2, 8), gate[0].expand(2, 8), gate[1:3])
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to"):
        torch.ops.torchgraft.swiglu_backward_(gate[1:3], gate[:2], torch.randn(2, 8))


def test_inplace_backward_op_takes_any_layout():
    gate, up = _inputs((8, 6), torch.float32)
    dy = torch.randn(6, 8).t()
    dgate_ref, dup_ref = torch.ops.torchgraft.geglu_backward(dy, gate, up, True)
    fused = torch.cat([gate, up], dim=1)  # chunks of a fused projection: strided views
    g_view, u_view = fused.chunk(2, dim=1)
    torch.ops.torchgraft.geglu_backward_(dy, g_view, u_view, True)
    assert torch.equal(g_view, dgate_ref) and torch.equal(u_view, dup_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_inplace_backward_op_contiguous_matches_out_of_place(dtype):
    # Contiguous operands take the in-place kernel (several threads' worth of elements); a
    # gradient sharing memory with gate takes the copying path: both give the same bits.
    gate, up = _inputs((300, 257), dtype)
    dy = torch.randn(300, 257).to(dtype)
    for tanh in (None, True, False):
        extra = () if tanh is None else (tanh,)
        name = "swiglu" if tanh is None else "geglu"
        dgate_ref, dup_ref = getattr(torch.ops.torchgraft, f"{name}_backward")(dy, gate, up, *extra)
        g, u = gate.clone(), up.clone()
        getattr(torch.ops.torchgraft, f"{name}_backward_")(dy, g, u, *extra)
        assert torch.equal(g, dgate_ref) and torch.equal(u, dup_ref)
        dgate_ref, dup_ref = getattr(torch.ops.torchgraft, f"{name}_backward")(
            gate, gate, up, *extra
        )
        g, u = gate.clone(), up.clone()
        getattr(torch.ops.torchgraft, f"{name}_backward_")(g, g, u, *extra)
        assert torch.equal(g, dgate_ref) and torch.equal(u, dup_ref)


def test_inplace_backward_compiles():
    def mlp(x, w_gate, w_up):
        return tgf.swiglu(x @ w_gate, x @ w_up, inplace_backward=True).sum()

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    x, w_gate, w_up = _mlp_inputs()
    compiled(x, w_gate, w_up).backward()
    got = [t.grad.clone() for t in (x, w_gate, w_up)]
    for t in (x, w_gate, w_up):
        t.grad = None
    mlp(x, w_gate, w_up).backward()
    for a, t in zip(got, (x, w_gate, w_up), strict=True):
        assert torch.allclose(a, t.grad)


def test_opcheck_inplace_backward():
    gate, up = _inputs((5, 6), torch.float32)
    grad = torch.randn(5, 6)
    torch.library.opcheck(torch.ops.torchgraft.swiglu_backward_, (grad, gate, up))
    torch.library.opcheck(torch.ops.torchgraft.geglu_backward_, (grad, gate, up, False))
