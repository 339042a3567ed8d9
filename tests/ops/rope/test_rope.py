"""torchgraft.functional.rope: values, gradients, layouts, errors, compile (CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.rope.reference import rope_eager, rope_reference, rotate_half

pytestmark = pytest.mark.default_torch

# Relative-norm tolerances against the float64 reference: one rounding of each output (a
# gradient too: the backward is the same kind of rotation).
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = list(TOL)


def _llama(batch, seq, heads, kv_heads, dim, dtype, requires_grad=False, rotary=None):
    """q and k as Llama's attention makes them: transposed views of (B, S, H, D) projections,
    and (B, S, rotary) cos/sin tables."""
    rotary = dim if rotary is None else rotary
    qp = torch.randn(batch, seq, heads * dim, dtype=torch.float64).to(dtype)
    kp = torch.randn(batch, seq, kv_heads * dim, dtype=torch.float64).to(dtype)
    qp.requires_grad_(requires_grad)
    kp.requires_grad_(requires_grad)
    q = qp.view(batch, seq, heads, dim).transpose(1, 2)
    k = kp.view(batch, seq, kv_heads, dim).transpose(1, 2)
    angles = torch.rand(batch, seq, rotary, dtype=torch.float64) * 6
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _check(q, k, cos, sin, unsqueeze_dim=1, tol=None):
    tol = tol or TOL[q.dtype]
    q_out, k_out = tgf.rope(q, k, cos, sin, unsqueeze_dim)
    q_ref, k_ref = rope_reference(q, k, cos, sin, unsqueeze_dim)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    if q.numel():
        assert rel_err(q_out, q_ref) < tol
    if k.numel():
        assert rel_err(k_out, k_ref) < tol
    return q_out, k_out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("batch", "seq", "heads", "kv_heads", "dim"),
    [(2, 7, 4, 2, 64), (1, 5, 3, 3, 128), (3, 1, 2, 1, 34), (1, 4, 2, 2, 2), (2, 3, 8, 1, 72)],
)
def test_forward_and_backward_match_float64(batch, seq, heads, kv_heads, dim, dtype):
    q, k, cos, sin = _llama(batch, seq, heads, kv_heads, dim, dtype, requires_grad=True)
    q_out, k_out = _check(q, k, cos, sin)
    gq = torch.randn(q_out.shape, dtype=torch.float64)
    gk = torch.randn(k_out.shape, dtype=torch.float64)
    qp, kp = q._base, k._base
    torch.autograd.backward((q_out, k_out), (gq.to(dtype), gk.to(dtype)))
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    q_ref, k_ref = rope_reference(q64, k64, cos, sin)
    torch.autograd.backward((q_ref, k_ref), (gq.to(dtype).double(), gk.to(dtype).double()))
    assert rel_err(qp.grad.view_as(q64.grad.transpose(1, 2)).transpose(1, 2), q64.grad) < TOL[dtype]
    assert rel_err(kp.grad.view_as(k64.grad.transpose(1, 2)).transpose(1, 2), k64.grad) < TOL[dtype]


def test_outputs_have_the_layout_eager_gives():
    q, k, cos, sin = _llama(2, 5, 4, 2, 16, torch.float32)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    eager_q = q * c + rotate_half(q) * s
    eager_k = k * c + rotate_half(k) * s
    assert q_out.stride() == eager_q.stride() and k_out.stride() == eager_k.stride()
    # Contiguous inputs give contiguous outputs.
    q_out, _ = tgf.rope(q.contiguous(), k, cos, sin)
    assert q_out.is_contiguous()
    # A non-dense input (a slice of a fused projection) gives a contiguous output.
    qkv = torch.randn(2, 5, 3 * 4 * 16)
    q_view = qkv[..., : 4 * 16].view(2, 5, 4, 16).transpose(1, 2)
    q_out, _ = _check(q_view, k, cos, sin)
    assert q_out.is_contiguous()


def test_gradients_reach_the_projections_without_a_copy():
    # SDPA's backward hands the output gradients over contiguous (B, H, S, D); the backward
    # writes them heads-innermost, the projections' layout, so the transposed view's backward
    # is a view too.
    q, k, cos, sin = _llama(2, 5, 4, 2, 16, torch.float32, requires_grad=True)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    gq, gk = torch.randn(q_out.shape), torch.randn(k_out.shape)
    dq, dk = torch.ops.torchgraft.rope_backward(gq, gk, cos, sin, 1)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    with torch.profiler.profile() as prof:
        torch.autograd.backward((q_out, k_out), (gq, gk))
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    assert copies == []
    # Heads at dim 2 (unsqueeze_dim=2): the contiguous layout is already heads-innermost.
    gq2 = torch.randn(2, 5, 4, 16)
    dq2, _ = torch.ops.torchgraft.rope_backward(gq2, gq2[:, :, :2], cos, sin, 2)
    assert dq2.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_heads_last_layout_with_unsqueeze_dim_2(dtype):
    q, k, cos, sin = _llama(2, 6, 4, 2, 32, dtype)
    _check(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    _check(q.transpose(1, 2).contiguous(), k.transpose(1, 2), cos, sin, unsqueeze_dim=-2)


def test_shared_two_dimensional_tables():
    q, k, cos, sin = _llama(2, 6, 4, 2, 32, torch.float32)
    _check(q, k, cos[0], sin[0], unsqueeze_dim=0)
    # A (1, S, D) table broadcast over the batch.
    _check(q, k, cos[:1], sin[:1])


@pytest.mark.parametrize("rotary", [8, 16, 30])
def test_partial_rotary_dims_pass_the_rest_through(rotary):
    q, k, cos, sin = _llama(2, 5, 4, 2, 32, torch.float32, rotary=rotary)
    q_out, k_out = _check(q, k, cos, sin)
    assert torch.equal(q_out[..., rotary:], q[..., rotary:])
    assert torch.equal(k_out[..., rotary:], k[..., rotary:])


def test_odd_strides_and_tables():
    # Non-contiguous tables (a slice of a wider table) and rows that are not adjacent.
    q, k, _, _ = _llama(2, 5, 4, 2, 16, torch.float32)
    wide = torch.randn(2, 5, 40)
    cos, sin = wide[..., :16], wide[..., 20:36]
    _check(q, k, cos, sin)
    # A table whose last dimension is strided.
    cos_t = torch.randn(2, 16, 5).transpose(1, 2)
    _check(q, k, cos_t, sin)
    # Rows with a strided last dimension.
    q_t = torch.randn(2, 4, 16, 5).transpose(2, 3)
    _check(q_t, k, cos, sin)


def test_more_than_three_unmergeable_leading_dims():
    # (A, B, H, S, D) heads with a (B, S, D) table broadcast over A and H: four leading dims
    # that no layout merges (the kernels then work on copies), contiguous or not.
    q = torch.randn(2, 3, 4, 5, 8)
    k = torch.randn(2, 3, 5, 2, 8).transpose(2, 3)
    cos, sin = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    q_out, k_out = _check(q, k, cos, sin, unsqueeze_dim=1)
    assert q_out.is_contiguous() and k_out.stride() == k.stride()


def test_empty_inputs():
    q, k, cos, sin = _llama(0, 5, 4, 2, 16, torch.float32, requires_grad=True)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    (q_out.sum() + k_out.sum()).backward()
    q, k, cos, sin = _llama(2, 0, 4, 2, 16, torch.float32)
    assert tgf.rope(q, k, cos, sin)[0].shape == q.shape


def test_mixed_dtypes_promote_as_eager():
    q, k, cos, sin = _llama(2, 5, 4, 2, 16, torch.bfloat16)
    q_out, k_out = tgf.rope(q, k, cos.float(), sin.float())
    q_ref, k_ref = rope_reference(q, k, cos.float(), sin.float())
    assert q_out.dtype == torch.float32 and k_out.dtype == torch.float32
    assert rel_err(q_out, q_ref) < TOL[torch.float32]
    assert rel_err(k_out, k_ref) < TOL[torch.float32]


def test_gradcheck_float64():
    q, k, cos, sin = _llama(2, 3, 2, 1, 8, torch.float64)
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: tgf.rope(q, k, cos, sin), (q, k))


def test_gradcheck_float64_with_table_gradients():
    q, k, cos, sin = _llama(2, 3, 2, 1, 8, torch.float64, rotary=6)
    args = tuple(t.detach().requires_grad_() for t in (q, k, cos, sin))
    assert torch.autograd.gradcheck(tgf.rope, args)


def test_runs_the_native_cpu_kernels():
    reset_stats()
    q, k, cos, sin = _llama(1, 4, 2, 1, 8, torch.bfloat16, requires_grad=True)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    got = stats()
    assert got["native/torchgraft::rope/CPU"]["calls"] == 1
    assert got["native/torchgraft::rope_backward/CPU"]["calls"] == 1


def test_bad_inputs_raise_like_eager():
    q, k, cos, sin = _llama(1, 4, 2, 1, 8, torch.float32)
    with pytest.raises(RuntimeError, match="must be even"):
        tgf.rope(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(RuntimeError, match="exceeds q's head dimension"):
        tgf.rope(q[..., :4], k, cos, sin)
    with pytest.raises(RuntimeError, match="must broadcast to q's size"):
        tgf.rope(q, k, cos.expand(3, 4, 8), sin.expand(3, 4, 8))
    # Tables of two shapes get the eager expression (its broadcasting error here).
    with pytest.raises(RuntimeError, match="must match the size of tensor"):
        tgf.rope(q, k, cos, sin[:, :2])
    with pytest.raises(RuntimeError, match="expected sin of size"):
        torch.ops.torchgraft.rope(q, k, cos, sin[:, :2], 1)
    with pytest.raises(RuntimeError, match="expected k to have dtype"):
        torch.ops.torchgraft.rope(q, k.double(), cos, sin, 1)
    with pytest.raises(RuntimeError, match="\"rope\" not implemented for 'Long'"):
        torch.ops.torchgraft.rope(q.long(), k.long(), cos.long(), sin.long(), 1)
    # What the kernels do not take runs the eager expression, with its results and errors.
    ints = [t.mul(4).long() for t in (q, k, cos, sin)]
    for got, want in zip(tgf.rope(*ints), rope_eager(*ints), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(IndexError, match="Dimension out of range"):
        tgf.rope(q, k, cos, sin, unsqueeze_dim=5)
    with pytest.raises(RuntimeError, match="Dimension out of range"):
        torch.ops.torchgraft.rope(q, k, cos, sin, 5)
    with pytest.raises(TypeError, match="unsqueeze_dim must be an int"):
        tgf.rope(q, k, cos, sin, unsqueeze_dim=1.0)


def test_opcheck():
    q, k, cos, sin = _llama(2, 3, 4, 2, 8, torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.torchgraft.rope, (q, k, cos, sin, 1))
    gq, gk = torch.randn(q.shape).transpose(1, 2).contiguous().transpose(1, 2), torch.randn(k.shape)
    torch.library.opcheck(torch.ops.torchgraft.rope_backward, (gq, gk, cos, sin, 1))
    # Tables broadcast over a batch of 1 too, and negative unsqueeze_dim.
    cos1, sin1 = cos[:1], sin[:1]
    torch.library.opcheck(torch.ops.torchgraft.rope_backward, (gq, gk, cos1, sin1, -3))


def test_compiles_fullgraph_without_graph_breaks():
    def attention_inputs(q, k, cos, sin):
        q_out, k_out = tgf.rope(q, k, cos, sin)
        return (q_out * 2).sum() + k_out.square().sum()

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")
    q, k, cos, sin = _llama(2, 3, 4, 2, 8, torch.float32)
    q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    out = compiled(q1, k1, cos, sin)
    out.backward()
    ref = attention_inputs(q2, k2, cos, sin)
    ref.backward()
    assert torch.allclose(out, ref)
    assert torch.allclose(q1.grad, q2.grad) and torch.allclose(k1.grad, k2.grad)
