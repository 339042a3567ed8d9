"""torchgraft.functional.swiglu_packed (SwiGLU of a packed ``[gate | up]`` projection): values,
gradients, layouts, errors, the in-place backward, compile (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err_in
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.glu.reference import swiglu_packed_eager, swiglu_packed_reference

pytestmark = pytest.mark.default_torch

OPS = torch.ops.torchgraft
# Relative-norm tolerances against the float64 reference: one rounding of the output.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = list(TOL)
# (..., 2I): odd row counts, I below / not a multiple of / a multiple of the vector width
# (8 bf16 or 16 f32 lanes), MoE's I = 768, 3-D, one row longer than a work item (8 Ki).
SHAPES = [(1, 2), (7, 6), (5, 34), (33, 64), (3, 1536), (2, 3, 26), (1, 2 * 8195), (4, 0), (0, 8)]


def _gate_up(shape, dtype, requires_grad=False) -> torch.Tensor:
    """Fresh random values (never zeros), the gate half scaled as pre-activations are."""
    x = torch.randn(shape, dtype=torch.float64)
    x[..., : shape[-1] // 2] *= 3
    return x.to(dtype).requires_grad_(requires_grad)


def _poison_freed_memory(nbytes: int) -> None:
    """Frees a block of NaN bytes of this size: malloc often hands it back to the next
    allocation of that size, so an element a kernel forgets to write reads as NaN. Best effort
    (the allocator may place the output elsewhere); graft-kernels' tests write into poisoned
    buffers outright."""
    poison = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32)
    del poison


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_float64(shape, dtype):
    gate_up = _gate_up(shape, dtype, requires_grad=True)
    y = tgf.swiglu_packed(gate_up)
    half = (*shape[:-1], shape[-1] // 2)
    assert y.dtype == dtype and y.shape == half and y.is_contiguous()
    gu64 = gate_up.detach().double().requires_grad_()
    y64 = swiglu_packed_reference(gu64)
    dy = torch.randn(half, dtype=torch.float64).to(dtype)
    y.backward(dy)
    y64.backward(dy.double())
    assert gate_up.grad.shape == gate_up.shape and gate_up.grad.dtype == dtype
    if y.numel() == 0:
        return
    assert rel_err_in(y, y64) < TOL[dtype]
    # The gradients are rounded once from products of rounded inputs: two roundings.
    assert rel_err_in(gate_up.grad, gu64.grad) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_write_every_element_of_their_outputs(dtype):
    # Element by element (a norm could hide a few unwritten ones), into freed NaN memory.
    gate_up = _gate_up((33, 2 * 130), dtype)
    dy = torch.randn(33, 130, dtype=torch.float64).to(dtype)
    y_bytes = dy.numel() * dy.element_size()
    _poison_freed_memory(y_bytes)
    y = OPS.swiglu_packed(gate_up)
    _poison_freed_memory(2 * y_bytes)
    d_gate_up = OPS.swiglu_packed_backward(dy, gate_up)
    gu64 = gate_up.double().requires_grad_()
    y64 = swiglu_packed_reference(gu64)
    y64.backward(dy.double())
    for got, want in ((y, y64), (d_gate_up, gu64.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want.detach(), rtol=4 * TOL[dtype], atol=1e-6)


def test_gradcheck_float64():
    gate_up = _gate_up((5, 18), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tgf.swiglu_packed, (gate_up,))
    gate_up3 = _gate_up((2, 3, 10), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tgf.swiglu_packed, (gate_up3,))


def test_matches_transformers_apply_gate_in_float32():
    gate_up = _gate_up((33, 2 * 17), torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(tgf.swiglu_packed(gate_up), F.silu(gate) * up, rtol=1e-6, atol=0)


def test_non_contiguous_input_is_copied():
    base = _gate_up((24, 16), torch.float32)
    gate_up = base.t()  # (16, 24): strided
    assert not gate_up.is_contiguous()
    sliced = _gate_up((6, 40), torch.float32)[:, ::2]  # (6, 20): gaps between elements
    for x in (gate_up, sliced):
        assert rel_err_in(tgf.swiglu_packed(x), swiglu_packed_reference(x)) < TOL[torch.float32]
        dy = torch.randn(*x.shape[:-1], x.shape[-1] // 2)
        leaf = x.detach().requires_grad_()
        ref = leaf.detach().double().requires_grad_()
        tgf.swiglu_packed(leaf).backward(dy)
        swiglu_packed_reference(ref).backward(dy.double())
        assert rel_err_in(leaf.grad, ref.grad) < 2 * TOL[torch.float32]


def test_runs_the_native_cpu_kernels():
    reset_stats()
    gate_up = _gate_up((8, 16), torch.bfloat16, requires_grad=True)
    tgf.swiglu_packed(gate_up).sum().backward()
    got = stats()
    assert got["native/torchgraft::swiglu_packed/CPU"]["calls"] == 1
    assert got["native/torchgraft::swiglu_packed_backward/CPU"]["calls"] == 1


def test_an_odd_last_dimension_raises_atens_message():
    message = "swiglu_packed: Halving dimension must be even, but dimension 1 is size 5"
    for x in (torch.randn(3, 5), torch.randn(3, 5, device="meta")):
        with pytest.raises(RuntimeError, match=message):
            tgf.swiglu_packed(x)
        with pytest.raises(RuntimeError, match=message):
            OPS.swiglu_packed(x)
    with pytest.raises(RuntimeError, match="does not support scalars"):
        tgf.swiglu_packed(torch.tensor(1.0))
    # The eager path (dtypes the kernels do not take) refuses it too.
    with pytest.raises(RuntimeError, match=message):
        tgf.swiglu_packed(torch.ones(3, 5, dtype=torch.int64))
    with pytest.raises(
        RuntimeError, match="swiglu_packed_backward: Halving dimension must be even"
    ):
        OPS.swiglu_packed_backward(torch.randn(3, 2), torch.randn(3, 5))


def test_the_ops_refuse_what_their_kernels_do_not_take():
    gate_up = _gate_up((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="\"swiglu_packed\" not implemented for 'Long'"):
        OPS.swiglu_packed(gate_up.long())
    with pytest.raises(
        RuntimeError, match=r"swiglu_packed_backward: expected grad of size \[4, 4\], got \[4, 8\]"
    ):
        OPS.swiglu_packed_backward(torch.randn(4, 8), gate_up)
    with pytest.raises(
        RuntimeError, match="swiglu_packed_backward: expected grad to have dtype Float, got Double"
    ):
        OPS.swiglu_packed_backward(torch.randn(4, 4, dtype=torch.float64), gate_up)
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        tgf.swiglu_packed(gate_up.long())


def test_other_dtypes_run_the_eager_expression():
    x = torch.randn(3, 8, dtype=torch.complex64)
    torch.testing.assert_close(tgf.swiglu_packed(x), swiglu_packed_eager(x))


def test_opcheck():
    gate_up = _gate_up((5, 12), torch.float32, requires_grad=True)
    torch.library.opcheck(OPS.swiglu_packed, (gate_up,))
    grad = torch.randn(5, 6)
    torch.library.opcheck(OPS.swiglu_packed_backward, (grad, gate_up.detach()))
    torch.library.opcheck(OPS.swiglu_packed_backward_, (grad, gate_up.detach().clone()))


def test_compiles_fullgraph_without_graph_breaks():
    def experts(x, w):
        return tgf.swiglu_packed(x @ w).sum()

    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 10, requires_grad=True)
    w = torch.randn(10, 2 * 12, requires_grad=True)
    out = compiled(x, w)
    out.backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ref = experts(x, w)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, (x.grad, w.grad))


# ------------------------------------------------------------------ the in-place backward


def _experts_inputs(dtype=torch.float32):
    """gate_up as MoE experts make it: a fresh projection of the routed rows."""
    x = torch.randn(7, 16, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(16, 2 * 12, dtype=torch.float64).to(dtype).requires_grad_()
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_backward_gives_the_same_gradients(dtype):
    x, w = _experts_inputs(dtype)
    dy = torch.randn(7, 12, dtype=torch.float64).to(dtype)
    grads = []
    for inplace in (False, True):
        tgf.swiglu_packed(x @ w, inplace_backward=inplace).backward(dy)
        grads.append([t.grad.clone() for t in (x, w)])
        x.grad = w.grad = None
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_inplace_backward_writes_over_gate_up():
    reset_stats()
    x, w = _experts_inputs()
    gate_up = x @ w
    before = gate_up.detach().clone()
    dy = torch.randn(7, 12)
    want = OPS.swiglu_packed_backward(dy, before)
    captured: dict[str, torch.Tensor] = {}
    gate_up.register_hook(lambda g: captured.setdefault("grad", g))
    tgf.swiglu_packed(gate_up, inplace_backward=True).backward(dy)
    # The gradient flowing to the projection is gate_up's own memory, holding [dgate | dup].
    assert captured["grad"].data_ptr() == gate_up.data_ptr()
    assert torch.equal(gate_up.detach(), want)
    got = stats()
    assert got["native/torchgraft::swiglu_packed_backward_/CPU"]["calls"] == 1
    assert got["native/torchgraft::swiglu_packed_backward/CPU"]["calls"] == 1  # `want` only


def test_inplace_backward_is_refused_where_it_would_be_wrong():
    # A recorded op that saved gate_up and runs its backward after ours: a version-counter
    # error, not gradients computed from overwritten values.
    x, w = _experts_inputs()
    gate_up = x @ w
    other = (gate_up * gate_up).sum()
    y = tgf.swiglu_packed(gate_up, inplace_backward=True).sum() + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # A leaf keeps its values and gets an ordinary gradient; so does a non-contiguous
    # intermediate.
    leaf = _gate_up((4, 8), torch.float32, requires_grad=True)
    before = leaf.detach().clone()
    tgf.swiglu_packed(leaf, inplace_backward=True).sum().backward()
    assert torch.equal(leaf.detach(), before) and leaf.grad.data_ptr() != leaf.data_ptr()
    x, w = _experts_inputs()
    strided = (x @ w).t().contiguous().t()
    before = strided.detach().clone()
    tgf.swiglu_packed(strided, inplace_backward=True).sum().backward()
    assert torch.equal(strided.detach(), before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(300, 2 * 257), (3, 7, 2 * 16), (5, 2), (0, 6)], ids=str)
def test_inplace_op_matches_the_allocating_op(shape, dtype):
    # Contiguous operands take the in-place kernel (several threads' worth of elements for the
    # first shape): the same bits as the allocating op.
    gate_up = _gate_up(shape, dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, dtype=torch.float64).to(dtype)
    want = OPS.swiglu_packed_backward(dy, gate_up)
    got = gate_up.clone()
    OPS.swiglu_packed_backward_(dy, got)
    assert torch.equal(got, want)


def test_inplace_op_on_strided_and_aliased_operands():
    gate_up = _gate_up((8, 12), torch.float32)
    dy = torch.randn(6, 8).t()  # a strided gradient
    want = OPS.swiglu_packed_backward(dy, gate_up)
    wide = torch.cat([gate_up, torch.randn(8, 4)], dim=1)
    view = wide[:, :12]  # a strided gate_up: computed into a new tensor and copied
    OPS.swiglu_packed_backward_(dy, view)
    assert torch.equal(view, want)
    # A gradient that is gate_up's own gate half: read through a copy, not overwritten first.
    g = gate_up.clone()
    want = OPS.swiglu_packed_backward(g[:, :6].clone(), g)
    OPS.swiglu_packed_backward_(g[:, :6], g)
    assert torch.equal(g, want)


def test_inplace_op_rejects_overlapping_outputs():
    gate_up = _gate_up((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        OPS.swiglu_packed_backward_(torch.randn(4, 4), gate_up[0].expand(4, 8))
    flat = torch.randn(40)
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to"):
        OPS.swiglu_packed_backward_(flat[4:20].view(4, 4), flat[:32].view(4, 8))


def test_inplace_backward_compiles():
    def experts(x, w):
        return tgf.swiglu_packed(x @ w, inplace_backward=True).sum()

    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x, w = _experts_inputs()
    compiled(x, w).backward()
    got = [t.grad.clone() for t in (x, w)]
    x.grad = w.grad = None
    experts(x, w).backward()
    for a, t in zip(got, (x, w), strict=True):
        torch.testing.assert_close(a, t.grad)
