"""torchgraft.functional.moe_sort / moe_permute / moe_unpermute (MoE token permutation) on CPU:
the kernels against float64 on fresh random inputs with poisoned outputs, gradients by
gradcheck, sentinels (expert parallelism), K = 1, one token, no tokens, errors, torch.compile
with the fake kernels, opcheck, and transformers' grouped_mm experts' math end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import functional as tgf
from torchgraft.ops.moe_permute.reference import (
    moe_permute_reference,
    moe_sort_reference,
    moe_unpermute_reference,
)

pytestmark = pytest.mark.default_torch

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Relative-norm tolerance against float64: the permutation is a copy (exact), the unpermute
# sums K products in float32 and rounds once to the output's dtype.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPS = torch.ops.torchgraft


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))


def _calls(op: str) -> int:
    return torchgraft.stats()[f"native/torchgraft::{op}/CPU"]["calls"]


def _routing(tokens: int, top_k: int, experts: int, sentinels: int = 0) -> torch.Tensor:
    """Random distinct experts per token; ``sentinels`` extra ids (>= experts) stand for
    another rank's experts."""
    scores = torch.rand(tokens, experts + sentinels)
    return scores.topk(top_k, dim=-1).indices


@pytest.fixture(autouse=True)
def _poisoned_allocations():
    """Fresh allocations filled with NaN (deterministic mode): an unwritten element shows."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


# ------------------------------------------------------------------------------- moe_sort


@pytest.mark.parametrize("sentinels", [0, 3])
def test_moe_sort_groups_pairs_by_expert(sentinels):
    ids = _routing(50, 4, 8, sentinels)
    before = _calls("moe_sort")
    perm, inv_perm, offsets, valid = tgf.moe_sort(ids, 8)
    assert _calls("moe_sort") == before + 1
    flat = ids.reshape(-1)
    assert perm.dtype == inv_perm.dtype == torch.int64 and offsets.dtype == torch.int32
    assert offsets.shape == (8,) and valid.shape == (1,)
    assert torch.equal(inv_perm[perm], torch.arange(200))
    local = flat < 8
    counts = torch.stack([(flat == e).sum() for e in range(8)])
    assert torch.equal(offsets.long(), counts.cumsum(0))
    assert int(valid) == int(local.sum())
    # Slots in expert order, stable (pairs ascending within an expert), sentinels last.
    keys = torch.where(local, flat, 8)[perm]
    assert bool((keys[1:] >= keys[:-1]).all())
    same = keys[1:] == keys[:-1]
    assert bool((perm[1:][same] > perm[:-1][same]).all())
    assert bool((keys[int(valid) :] == 8).all())


@pytest.mark.parametrize(
    ("shape", "experts", "low", "high"),
    [((1, 1), 1, 0, 1), ((300, 8), 64, 0, 64), ((7, 3), 5, -3, 9), ((2, 4, 6), 16, -1, 20)],
)
def test_moe_sort_kernel_equals_torchs_sort(shape, experts, low, high):
    """The counting sort gives exactly the stable sort and search of torch's ops, with ids of
    other ranks on both sides of the local range and ids of any shape."""
    ids = torch.randint(low, high, shape)
    got = tgf.moe_sort(ids, experts)
    want = moe_sort_reference(ids, experts)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_moe_sort_of_no_tokens():
    perm, inv_perm, offsets, valid = tgf.moe_sort(torch.zeros(0, 2, dtype=torch.int64), 4)
    assert perm.shape == inv_perm.shape == (0,)
    assert offsets.tolist() == [0, 0, 0, 0] and valid.tolist() == [0]
    with pytest.raises(ValueError, match="num_experts must be at least 1"):
        tgf.moe_sort(torch.zeros(2, 2, dtype=torch.int64), 0)


def test_moe_sort_of_other_dtypes_runs_torchs_ops():
    ids = torch.randint(0, 6, (20, 2))
    before = _calls("moe_sort")
    got = tgf.moe_sort(ids.int(), 6)
    assert _calls("moe_sort") == before
    for g, w in zip(got, moe_sort_reference(ids, 6), strict=True):
        assert torch.equal(g, w)


# --------------------------------------------------------------------------- forward values


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "hidden", "sentinels"),
    [(1, 1, 1, 8, 0), (1, 4, 8, 5, 0), (37, 1, 4, 16, 0), (64, 4, 8, 32, 0), (33, 8, 16, 24, 5)],
)
def test_forward_matches_float64(dtype, tokens, top_k, experts, hidden, sentinels):
    ids = _routing(tokens, top_k, experts, sentinels)
    perm, inv_perm, _, valid = tgf.moe_sort(ids, experts)
    x = torch.randn(tokens, hidden).to(dtype)
    before = _calls("moe_permute")
    out = tgf.moe_permute(x, perm, valid, top_k)
    assert _calls("moe_permute") == before + 1
    assert out.dtype == dtype and out.shape == (tokens * top_k, hidden)
    # A copy, exact; the sentinel rows zero.
    assert torch.equal(out, moe_permute_reference(x, perm, valid, top_k))
    assert bool((out[int(valid) :] == 0).all())

    y = torch.randn(tokens * top_k, hidden).to(dtype)
    w = torch.rand(tokens, top_k)
    before = _calls("moe_unpermute")
    for weights in (None, w, w.to(dtype)):
        got = tgf.moe_unpermute(y, inv_perm, valid, weights, top_k)
        w64 = None if weights is None else weights.double()
        want = moe_unpermute_reference(y.double(), inv_perm, valid, w64, top_k)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        assert _rel(got, want) <= TOL[dtype]
    assert _calls("moe_unpermute") == before + 3


def test_sentinel_rows_count_for_nothing_even_when_nan():
    ids = torch.tensor([[0, 9], [1, 0], [9, 1]])  # 9: another rank's expert
    _, inv_perm, offsets, valid = tgf.moe_sort(ids, 2)
    assert offsets.tolist() == [2, 4] and valid.tolist() == [4]
    y = torch.randn(6, 3)
    y[4:] = float("nan")  # what grouped_mm leaves in the sentinel rows
    w = torch.rand(3, 2)
    out = tgf.moe_unpermute(y, inv_perm, valid, w, 2)
    assert bool(out.isfinite().all())
    assert torch.allclose(out, moe_unpermute_reference(y, inv_perm, valid, w, 2))


def test_valid_may_be_int64_and_is_clamped():
    ids = _routing(6, 2, 4)
    perm, inv_perm, _, _ = tgf.moe_sort(ids, 4)
    x, y = torch.randn(6, 4), torch.randn(12, 4)
    for v in (torch.tensor([5]), torch.tensor(7, dtype=torch.int32), torch.tensor([-3]),
              torch.tensor([40])):  # fmt: skip
        assert torch.equal(tgf.moe_permute(x, perm, v, 2), moe_permute_reference(x, perm, v, 2)), v
        assert torch.allclose(
            tgf.moe_unpermute(y, inv_perm, v, None, 2),
            moe_unpermute_reference(y, inv_perm, v, None, 2),
        ), v


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_no_tokens_and_no_columns(dtype):
    perm, inv_perm, _, valid = tgf.moe_sort(torch.zeros(0, 3, dtype=torch.int64), 4)
    x = torch.randn(0, 8, dtype=dtype, requires_grad=True)
    out = tgf.moe_permute(x, perm, valid, 3)
    assert out.shape == (0, 8)
    y = torch.randn(0, 8, dtype=dtype, requires_grad=True)
    w = torch.rand(0, 3, requires_grad=True)
    back = tgf.moe_unpermute(y, inv_perm, valid, w, 3)
    assert back.shape == (0, 8)
    (out.sum() + back.sum()).backward()
    assert x.grad.shape == (0, 8) and y.grad.shape == (0, 8) and w.grad.shape == (0, 3)
    # Rows of no columns: the weights' gradient is a dot product of nothing.
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(4, 2, 4), 4)
    y = torch.randn(8, 0, dtype=dtype, requires_grad=True)
    w = torch.rand(4, 2, requires_grad=True)
    out = tgf.moe_unpermute(y, inv_perm, valid, w, 2)
    assert out.shape == (4, 0)
    dy, dw = torch.autograd.grad(out, (y, w), torch.ones(4, 0, dtype=dtype))
    assert dy.shape == (8, 0) and torch.equal(dw, torch.zeros(4, 2))


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize(("tokens", "top_k", "sentinels"), [(7, 2, 2), (5, 1, 0), (1, 3, 1)])
def test_gradients_by_gradcheck(tokens, top_k, sentinels):
    ids = _routing(tokens, top_k, 4, sentinels)
    perm, inv_perm, _, valid = tgf.moe_sort(ids, 4)
    x = torch.randn(tokens, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * top_k, 6, dtype=torch.float64, requires_grad=True)
    w = torch.rand(tokens, top_k, dtype=torch.float64, requires_grad=True)
    before = _calls("moe_unpermute_backward")
    assert torch.autograd.gradcheck(lambda x: tgf.moe_permute(x, perm, valid, top_k), (x,))
    assert torch.autograd.gradcheck(
        lambda y, w: tgf.moe_unpermute(y, inv_perm, valid, w, top_k), (y, w)
    )
    assert torch.autograd.gradcheck(
        lambda y: tgf.moe_unpermute(y, inv_perm, valid, None, top_k), (y,)
    )
    assert _calls("moe_unpermute_backward") > before


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("weights_dtype", [torch.float32, "same", None])
def test_backward_matches_float64(dtype, weights_dtype):
    tokens, top_k, experts, hidden = 48, 4, 8, 40
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(tokens, top_k, experts, 3), experts)
    y0 = torch.randn(tokens * top_k, hidden).to(dtype)
    w0 = torch.rand(tokens, top_k)
    if weights_dtype == "same":
        w0 = w0.to(dtype)
    grad = torch.randn(tokens, hidden).to(dtype)
    y, y64 = y0.clone().requires_grad_(), y0.double().requires_grad_()
    w = None if weights_dtype is None else w0.clone().requires_grad_()
    w64 = None if w is None else w0.double().requires_grad_()
    tgf.moe_unpermute(y, inv_perm, valid, w, top_k).backward(grad)
    moe_unpermute_reference(y64, inv_perm, valid, w64, top_k).backward(grad.double())
    assert y.grad.dtype == dtype and _rel(y.grad, y64.grad) <= TOL[dtype]
    if w is not None:
        assert w.grad.dtype == w0.dtype
        tol = 1e-6 if w0.dtype == torch.float32 else max(TOL[w0.dtype], 1e-12)
        assert _rel(w.grad, w64.grad) <= tol
    x0 = torch.randn(tokens, hidden).to(dtype)
    dout = torch.randn(tokens * top_k, hidden).to(dtype)
    x, x64 = x0.clone().requires_grad_(), x0.double().requires_grad_()
    tgf.moe_permute(x, perm, valid, top_k).backward(dout)
    moe_permute_reference(x64, perm, valid, top_k).backward(dout.double())
    assert x.grad.dtype == dtype and _rel(x.grad, x64.grad) <= TOL[dtype]


def test_backward_op_writes_every_element():
    """The backward op directly, with NaN-poisoned allocations: dy zero in the sentinel rows,
    the weights' gradient zero for the sentinel pairs."""
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(9, 3, 4, 2), 4)
    y, grad, w = torch.randn(27, 5), torch.randn(9, 5), torch.rand(9, 3)
    dy, dw = OPS.moe_unpermute_backward(grad, y, perm, inv_perm, valid, w, 3)
    assert bool(dy.isfinite().all()) and bool(dw.isfinite().all())
    v = int(valid)
    assert bool((dy[v:] == 0).all())
    assert bool((dw.reshape(-1)[perm[v:]] == 0).all())
    dy, empty = OPS.moe_unpermute_backward(grad, y, perm, inv_perm, valid, None, 3)
    assert empty.shape == (0,) and torch.equal(dy, OPS.moe_permute(grad, perm, valid, 3))


# -------------------------------------------------------------------------------- errors


def test_errors_are_atens():
    with pytest.raises(RuntimeError, match="expected expert_ids to have dtype Long, got Int"):
        OPS.moe_sort(torch.zeros(3, 2, dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="num_experts must be at least 1, got 0"):
        OPS.moe_sort(torch.zeros(3, 2, dtype=torch.int64), 0)
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(4, 2, 4), 4)
    x, y = torch.randn(4, 3), torch.randn(8, 3)
    with pytest.raises(RuntimeError, match="top_k must be at least 1, got 0"):
        OPS.moe_permute(x, perm, valid, 0)
    with pytest.raises(RuntimeError, match=r"expected perm of size \[12\] \(tokens \* top_k\)"):
        OPS.moe_permute(x, perm, valid, 3)
    with pytest.raises(RuntimeError, match="expected perm to have dtype Long, got Int"):
        OPS.moe_permute(x, perm.int(), valid, 2)
    with pytest.raises(RuntimeError, match="expected valid to have dtype Int or Long, got Float"):
        OPS.moe_permute(x, perm, valid.float(), 2)
    with pytest.raises(RuntimeError, match="valid has 2 elements, expected 1"):
        OPS.moe_permute(x, perm, torch.tensor([1, 2]), 2)
    with pytest.raises(RuntimeError, match="index 8 is out of bounds for dimension 0 with size 8"):
        OPS.moe_permute(x, torch.where(perm == 0, 8, perm), valid, 2)
    with pytest.raises(RuntimeError, match="index -1 is out of bounds"):
        OPS.moe_unpermute(y, torch.where(inv_perm == 3, -1, inv_perm), valid, None, 2)
    with pytest.raises(
        RuntimeError, match=r"expected the rows of y \(8\) to be a multiple of top_k"
    ):
        OPS.moe_unpermute(y, inv_perm, valid, None, 3)
    with pytest.raises(RuntimeError, match=r"expected weights of size \[4, 2\], got \[4, 3\]"):
        OPS.moe_unpermute(y, inv_perm, valid, torch.rand(4, 3), 2)
    with pytest.raises(RuntimeError, match="not inverse permutations"):
        OPS.moe_unpermute_backward(x, y, perm, perm.flip(0), valid, None, 2)
    with pytest.raises(RuntimeError, match="expected y to have dtype Float, got Double"):
        OPS.moe_unpermute_backward(x, y.double(), perm, inv_perm, valid, None, 2)
    # Another device is never read across: meta with CPU (no second real device here).
    with pytest.raises(RuntimeError, match="same device"):
        OPS.moe_permute(x, perm.to("meta"), valid, 2)
    with pytest.raises(RuntimeError, match="same device"):
        OPS.moe_unpermute(y, inv_perm, valid.to("meta"), None, 2)
    # The faces send what the kernels do not take to torch's ops (torch's errors and values).
    with pytest.raises((IndexError, RuntimeError)):
        tgf.moe_permute(x, perm.int() + 100, valid, 2)
    ints = torch.randint(0, 5, (4, 3))
    assert torch.equal(
        tgf.moe_permute(ints, perm, valid, 2), moe_permute_reference(ints, perm, valid, 2)
    )


# ---------------------------------------------------------------------- compile, opcheck


def test_compiles_fullgraph_and_matches_eager():
    ids = _routing(16, 2, 4, 1)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.rand(16, 2, requires_grad=True)

    def block(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        perm, inv_perm, _, valid = tgf.moe_sort(ids, 4)
        rows = tgf.moe_permute(x, perm, valid, 2)
        return tgf.moe_unpermute(torch.tanh(rows), inv_perm, valid, w, 2)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x, w, ids)
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    ref = block(x, w, ids)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w))
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)


def test_opcheck():
    perm, inv_perm, _, valid = tgf.moe_sort(_routing(6, 2, 4, 1), 4)
    x = torch.randn(6, 5, requires_grad=True)
    y = torch.randn(12, 5, requires_grad=True)
    w = torch.rand(6, 2, requires_grad=True)
    torch.library.opcheck(OPS.moe_sort, (_routing(6, 2, 4, 1), 4))
    torch.library.opcheck(OPS.moe_permute, (x, perm, valid, 2))
    torch.library.opcheck(OPS.moe_unpermute, (y, inv_perm, valid, w, 2))
    torch.library.opcheck(OPS.moe_unpermute, (y, inv_perm, valid, None, 2))
    grad = torch.randn(6, 5)
    torch.library.opcheck(
        OPS.moe_unpermute_backward, (grad, y.detach(), perm, inv_perm, valid, w.detach(), 2)
    )


# ------------------------------------------------------------ transformers' grouped_mm math


def _experts_stock(hidden, top_k_index, top_k_weights, gate_up, down, num_experts):
    """transformers 5.17's ``grouped_mm_experts_forward`` (integrations/moe.py) with gated
    SiLU experts, in torch's ops: sort, gather, sentinel masks, two grouped GEMMs, weights,
    ``weighted_out[inv_perm].view(T, K, H).sum(1)``."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float()
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    sentinel_mask = (expert_ids_g >= num_experts).unsqueeze(-1)
    selected = selected.masked_fill(sentinel_mask, 0.0)
    proj = _grouped(selected, gate_up, offsets).masked_fill(sentinel_mask, 0.0)
    gate, up = proj.chunk(2, dim=-1)
    proj = F.silu(gate) * up
    proj = _grouped(proj, down, offsets).masked_fill(sentinel_mask, 0.0)
    weighted_out = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0))
    weighted_out = weighted_out[inv_perm]
    out = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden.dtype)


def _experts_graft(hidden, top_k_index, top_k_weights, gate_up, down, num_experts):
    """The same experts with moe_sort / moe_permute / moe_unpermute."""
    top_k = top_k_index.size(-1)
    perm, inv_perm, offsets, valid = tgf.moe_sort(top_k_index, num_experts)
    rows = tgf.moe_permute(hidden, perm, valid, top_k)
    gate, up = _grouped(rows, gate_up, offsets).chunk(2, dim=-1)
    proj = _grouped(F.silu(gate) * up, down, offsets)
    return tgf.moe_unpermute(proj, inv_perm, valid, top_k_weights, top_k)


def _grouped(x, weight, offsets):
    """``x @ weight[e].T`` for each expert's rows (``torch._grouped_mm`` where it takes the
    call, else a loop); rows beyond ``offsets[-1]`` are zero."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ weight[e].T
        start = end
    return out


@pytest.mark.parametrize("sentinels", [0, 2])
def test_matches_transformers_grouped_mm_experts(sentinels):
    """Qwen3-MoE-like block (T=64, K=4, E=8, H=32): equal output and gradients of the hidden
    states, the routing weights and the expert weights."""
    tokens, top_k, experts, hidden_dim, inter = 64, 4, 8, 32, 16
    ids = _routing(tokens, top_k, experts, sentinels)
    scores = torch.rand(tokens, top_k)
    leaves = [
        torch.randn(tokens, hidden_dim),
        scores / scores.sum(-1, keepdim=True),
        torch.randn(experts, 2 * inter, hidden_dim) / 6,
        torch.randn(experts, hidden_dim, inter) / 4,
    ]
    grad = torch.randn(tokens, hidden_dim)
    results = []
    for experts_forward in (_experts_stock, _experts_graft):
        args = [t.clone().requires_grad_() for t in leaves]
        h, w, gu, dn = args
        out = experts_forward(h, ids, w, gu, dn, experts)
        out.backward(grad)
        results.append((out, *(a.grad for a in args)))
    names = ["out", "hidden", "weights", "gate_up", "down"]
    for name, got, want in zip(names, *results[::-1], strict=True):
        assert _rel(got, want) <= 1e-5, name
