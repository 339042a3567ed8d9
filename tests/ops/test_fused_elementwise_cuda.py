"""SwiGLU, GeGLU and RoPE on CUDA: the native CUDA kernels against float64 references (every
dtype, odd sizes, both unit sizes of the kernels, layouts), gradients, the in-place backward,
output layouts, and that the CUDA kernels are the ones that ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err, rel_err_in
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.glu.reference import geglu_reference, swiglu_reference
from torchgraft.ops.rope.reference import rope_reference, rotate_half

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]

DEV = "cuda"
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = list(TOL)
GLU = [
    ("swiglu", lambda g, u, **kw: tgf.swiglu(g, u, **kw), swiglu_reference),
    ("geglu", lambda g, u, **kw: tgf.geglu(g, u, **kw), lambda g, u: geglu_reference(g, u)),
    (
        "geglu_tanh",
        lambda g, u, **kw: tgf.geglu(g, u, "tanh", **kw),
        lambda g, u: geglu_reference(g, u, "tanh"),
    ),
]


def _glu_inputs(shape, dtype, requires_grad=False):
    gate = (torch.randn(shape, dtype=torch.float64, device=DEV) * 3).to(dtype)
    up = torch.randn(shape, dtype=torch.float64, device=DEV).to(dtype)
    return gate.requires_grad_(requires_grad), up.requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 8*1024+8 and 4096 take the 16-byte-pack path; odd sizes the one-element path.
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 13), (64, 1000), (8 * 1024 + 8,), (0, 8)])
@pytest.mark.parametrize(("name", "op", "ref"), GLU, ids=[o[0] for o in GLU])
def test_glu_matches_float64(name, op, ref, shape, dtype):
    gate, up = _glu_inputs(shape, dtype, requires_grad=True)
    y = op(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape and y.is_cuda
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    y64 = ref(g64, u64)
    dy = torch.randn(shape, dtype=torch.float64, device=DEV).to(dtype)
    y.backward(dy)
    y64.backward(dy.double())
    if y.numel() == 0:
        return
    # rel_err_in: a lone float16 element can round to a subnormal (exact GELU of -4.5 is -1.5e-5,
    # below float16's smallest normal), where the dtype has no relative precision left.
    assert rel_err_in(y, y64) < TOL[dtype]
    assert rel_err_in(gate.grad, g64.grad) < 2 * TOL[dtype]
    assert rel_err_in(up.grad, u64.grad) < 2 * TOL[dtype]


def test_glu_unaligned_views_take_the_one_element_path():
    base_g, base_u = _glu_inputs((4097,), torch.bfloat16)
    gate, up = base_g[1:], base_u[1:]  # 2-byte offsets: no 16-byte packs
    assert rel_err(tgf.swiglu(gate, up), swiglu_reference(gate, up)) < TOL[torch.bfloat16]


@pytest.mark.parametrize(("name", "op", "ref"), GLU, ids=[o[0] for o in GLU])
def test_glu_gradcheck_float64(name, op, ref):
    gate, up = _glu_inputs((4, 9), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: op(g, u), (gate, up))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("name", "op", "ref"), GLU, ids=[o[0] for o in GLU])
def test_glu_inplace_backward_writes_the_gradients_over_gate_and_up(name, op, ref, dtype):
    reset_stats()
    x = torch.randn(64, 128, device=DEV, dtype=dtype, requires_grad=True)
    w_gate = torch.randn(128, 256, device=DEV, dtype=dtype, requires_grad=True)
    w_up = torch.randn(128, 256, device=DEV, dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 256, device=DEV, dtype=dtype)
    grads = []
    for inplace in (False, True):
        gate, up = x @ w_gate, x @ w_up
        seen = {}
        gate.register_hook(lambda g, seen=seen: seen.setdefault("gate", g))
        op(gate, up, inplace_backward=inplace).backward(dy)
        assert (seen["gate"].data_ptr() == gate.data_ptr()) == inplace
        grads.append([t.grad.clone() for t in (x, w_gate, w_up)])
        for t in (x, w_gate, w_up):
            t.grad = None
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    op_name = "swiglu" if name == "swiglu" else "geglu"
    assert stats()[f"native/torchgraft::{op_name}_backward_/CUDA"]["calls"] == 1


def test_glu_inplace_op_on_strided_views_and_aliased_grad():
    gate, up = _glu_inputs((16, 24), torch.float32)
    dy = torch.randn(16, 24, device=DEV)
    dgate, dup = torch.ops.torchgraft.swiglu_backward(dy, gate, up)
    fused = torch.cat([gate, up], dim=1)
    g_view, u_view = fused.chunk(2, dim=1)
    torch.ops.torchgraft.swiglu_backward_(dy, g_view, u_view)
    assert torch.equal(g_view, dgate) and torch.equal(u_view, dup)
    # The gradient may be gate itself: each element is read before it is written.
    g2, u2 = gate.clone(), up.clone()
    dgate2, dup2 = torch.ops.torchgraft.swiglu_backward(g2, g2, u2)
    torch.ops.torchgraft.swiglu_backward_(g2, g2, u2)
    assert torch.equal(g2, dgate2) and torch.equal(u2, dup2)


def test_glu_matches_eager_and_runs_the_cuda_kernels():
    reset_stats()
    gate, up = _glu_inputs((33, 17), torch.float32, requires_grad=True)
    assert rel_err(tgf.swiglu(gate, up), F.silu(gate) * up) < 1e-6
    assert rel_err(tgf.geglu(gate, up), F.gelu(gate) * up) < 1e-6
    tgf.swiglu(gate, up).sum().backward()
    got = stats()
    assert got["native/torchgraft::swiglu/CUDA"]["calls"] == 2
    assert got["native/torchgraft::swiglu_backward/CUDA"]["calls"] == 1
    assert got["native/torchgraft::geglu/CUDA"]["calls"] == 1


def test_glu_opcheck_and_compile():
    gate, up = _glu_inputs((5, 6), torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.torchgraft.swiglu, (gate, up))
    torch.library.opcheck(torch.ops.torchgraft.geglu, (gate, up, True))
    grad = torch.randn(5, 6, device=DEV)
    torch.library.opcheck(torch.ops.torchgraft.swiglu_backward, (grad, gate.detach(), up.detach()))
    torch.library.opcheck(
        torch.ops.torchgraft.swiglu_backward_, (grad, gate.detach().clone(), up.detach().clone())
    )

    def mlp(g, u):
        return tgf.swiglu(g, u).sum() + tgf.geglu(g, u, "tanh").sum()

    compiled = torch.compile(mlp, fullgraph=True)
    out = compiled(gate, up)
    out.backward()
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    mlp(g2, u2).backward()
    assert torch.allclose(gate.grad, g2.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ RoPE


def _llama(batch, seq, heads, kv_heads, dim, dtype, rotary=None, requires_grad=False):
    rotary = dim if rotary is None else rotary
    qp = torch.randn(batch, seq, heads * dim, dtype=torch.float64, device=DEV).to(dtype)
    kp = torch.randn(batch, seq, kv_heads * dim, dtype=torch.float64, device=DEV).to(dtype)
    qp.requires_grad_(requires_grad)
    kp.requires_grad_(requires_grad)
    q = qp.view(batch, seq, heads, dim).transpose(1, 2)
    k = kp.view(batch, seq, kv_heads, dim).transpose(1, 2)
    angles = torch.rand(batch, seq, rotary, dtype=torch.float64, device=DEV) * 6
    return qp, kp, q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("batch", "seq", "heads", "kv_heads", "dim", "rotary"),
    [
        (2, 33, 8, 2, 64, 64),  # packs
        (1, 17, 4, 4, 128, 128),
        (2, 5, 3, 1, 72, 72),  # h = 36: one element at a time for 16-bit types
        (1, 9, 4, 2, 96, 64),  # partial rotary, pass-through packs
        (2, 3, 2, 1, 6, 4),  # tiny, partial
        (0, 4, 2, 1, 16, 16),
    ],
)
def test_rope_matches_float64(batch, seq, heads, kv_heads, dim, rotary, dtype):
    qp, kp, q, k, cos, sin = _llama(batch, seq, heads, kv_heads, dim, dtype, rotary, True)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_cuda
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    q_ref, k_ref = rope_reference(q64, k64, cos, sin)
    gq = torch.randn(q_out.shape, dtype=torch.float64, device=DEV).to(dtype)
    gk = torch.randn(k_out.shape, dtype=torch.float64, device=DEV).to(dtype)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    torch.autograd.backward((q_ref, k_ref), (gq.double(), gk.double()))
    if q.numel() == 0:
        return
    assert rel_err(q_out, q_ref) < TOL[dtype] and rel_err(k_out, k_ref) < TOL[dtype]
    dq = qp.grad.view(batch, seq, heads, dim).transpose(1, 2)
    dk = kp.grad.view(batch, seq, kv_heads, dim).transpose(1, 2)
    assert rel_err(dq, q64.grad) < TOL[dtype] and rel_err(dk, k64.grad) < TOL[dtype]


def test_rope_layouts_tables_and_unsqueeze_dims():
    _, _, q, k, cos, sin = _llama(2, 6, 4, 2, 32, torch.bfloat16)
    # Rows inside wider ones, starting 2 bytes off a 16-byte boundary: not dense, no packs.
    wide = torch.randn(2, 6, 4, 48, device=DEV, dtype=torch.bfloat16)
    q_odd = wide[..., 1:33].transpose(1, 2)
    cases = [
        (q, k, cos, sin, 1),
        (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2),
        (q.contiguous(), k, cos[0], sin[0], 0),
        (q, k, cos[:1], sin[:1], 1),
        (q_odd, k, cos, sin, 1),
    ]
    for qq, kk, c, s, dim in cases:
        q_out, k_out = tgf.rope(qq, kk, c, s, dim)
        q_ref, k_ref = rope_reference(qq, kk, c, s, dim)
        assert rel_err(q_out, q_ref) < TOL[torch.bfloat16]
        assert rel_err(k_out, k_ref) < TOL[torch.bfloat16]


def test_rope_output_strides_are_eagers():
    _, _, q, k, cos, sin = _llama(2, 5, 4, 2, 64, torch.bfloat16)
    q_out, k_out = tgf.rope(q, k, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    assert q_out.stride() == (q * c + rotate_half(q) * s).stride()
    assert k_out.stride() == (k * c + rotate_half(k) * s).stride()


def test_rope_gradcheck_float64_and_runs_the_cuda_kernels():
    reset_stats()
    _, _, q, k, cos, sin = _llama(2, 3, 2, 1, 8, torch.float64, rotary=6)
    args = tuple(t.detach().requires_grad_() for t in (q, k, cos, sin))
    assert torch.autograd.gradcheck(tgf.rope, args)
    assert stats()["native/torchgraft::rope/CUDA"]["calls"] > 0
    assert stats()["native/torchgraft::rope_backward/CUDA"]["calls"] > 0


def test_rope_opcheck_and_compile():
    _, _, q, k, cos, sin = _llama(2, 3, 4, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.torchgraft.rope, (q, k, cos, sin, 1))
    torch.library.opcheck(torch.ops.torchgraft.rope_backward, (q, k, cos, sin, 1))

    def f(q, k):
        q_out, k_out = tgf.rope(q, k, cos, sin)
        return (q_out * 2).sum() + k_out.square().sum()

    q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    torch.compile(f, fullgraph=True)(q1, k1).backward()
    f(q2, k2).backward()
    assert torch.allclose(q1.grad, q2.grad, atol=1e-5)
    assert torch.allclose(k1.grad, k2.grad, atol=1e-5)
