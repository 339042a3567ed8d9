"""torchgraft.functional.linear_cross_entropy: values, gradients, chunks, errors, compile (CPU).

Every test runs under each scheme of the op
(crates/graft-native/src/ops/linear_cross_entropy/plan.rs): the automatic choice (row chunks), row
chunks forced, and the two-pass vocabulary-blocked scheme forced with groups and blocks small enough
that these shapes have several of each (``TORCHGRAFT_LCE_SCHEME``, read by the op at each call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from conftest import rel_err
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.cross_entropy.reference import cross_entropy_reference

pytestmark = pytest.mark.default_torch


@pytest.fixture(autouse=True)
def _own_rng():
    """Seeded random numbers that leave the global generator as they found it (the tests
    after these ones see the same random inputs with or without them)."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(0)
        yield


#: TORCHGRAFT_LCE_SCHEME per scheme: unset (the automatic choice), row chunks, two passes over
#: groups of 5 rows and blocks of 7 classes, 16-bit d_hidden products 2 rows at a time.
SCHEMES = {"auto": None, "rows": "rows", "two_pass": "5,7,2"}


@pytest.fixture(autouse=True, params=list(SCHEMES))
def scheme(request, monkeypatch):
    value = SCHEMES[request.param]
    if value is None:
        monkeypatch.delenv("TORCHGRAFT_LCE_SCHEME", raising=False)
    else:
        monkeypatch.setenv("TORCHGRAFT_LCE_SCHEME", value)
    return request.param


REDUCTIONS = ["mean", "sum", "none"]
# Against float64 logits of the same (rounded) inputs. The logits GEMM rounds to the dtype (as
# the eager `hidden @ weight.T` does), and the weight gradient once per chunk.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.5e-2, torch.float16: 2.5e-3}


def _inputs(n, h, v, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    hidden = rand(n, h)
    weight = rand(v, h, scale=h**-0.5 * 3)
    b = rand(v) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[1::5] = -100
    return hidden, weight, b, target


def _reference(hidden, weight, bias, target, reduction, go):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    loss = cross_entropy_reference(F.linear(h, w, b), target, -100, reduction)
    loss.backward(go)
    return loss, h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk_size", [None, 1, 7])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_loss_and_gradients_match_float64(dtype, bias, chunk_size, reduction):
    hidden, weight, b, target = _inputs(37, 24, 50, dtype, bias)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    bl = None if b is None else b.clone().requires_grad_()
    loss = tgf.linear_cross_entropy(
        leaves[0], leaves[1], target, bl, reduction=reduction, chunk_size=chunk_size
    )
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    go = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    ref = _reference(hidden, weight, b, target, reduction, go)
    assert loss.shape == ref[0].shape
    loss.backward(go.to(loss.dtype))
    assert rel_err(loss, ref[0]) < TOL[dtype]
    grads = [leaves[0].grad, leaves[1].grad, None if bl is None else bl.grad]
    for name, got, want in zip(["hidden", "weight", "bias"], grads, ref[1:], strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == dtype and got.shape == want.shape, name
        assert rel_err(got, want) < TOL[dtype], name


def _numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f at x (float64)."""
    flat = x.detach().clone().view(-1)
    out = torch.zeros_like(flat)
    for k in range(flat.numel()):
        keep = flat[k].item()
        flat[k] = keep + eps
        hi = f(flat.view_as(x)).item()
        flat[k] = keep - eps
        lo = f(flat.view_as(x)).item()
        flat[k] = keep
        out[k] = (hi - lo) / (2 * eps)
    return out.view_as(x)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_float64(reduction):
    hidden, weight, b, target = _inputs(6, 4, 7, torch.float64)
    args = [t.requires_grad_() for t in (hidden, weight, b)]

    def loss(h, w, bias):
        return tgf.linear_cross_entropy(h, w, target, bias, reduction=reduction, chunk_size=4)

    if reduction == "none":
        assert torch.autograd.gradcheck(loss, args)
        return
    # Gradients computed in the forward are consumed by one backward, and gradcheck runs
    # several through one graph: compare one backward with central differences instead.
    for i in range(3):

        def of_one(x, i=i):
            with torch.no_grad():
                return loss(*[x if j == i else t for j, t in enumerate(args)])

        x = args[i].detach().clone().requires_grad_()
        (analytic,) = torch.autograd.grad(
            loss(*[x if j == i else t.detach() for j, t in enumerate(args)]), x
        )
        torch.testing.assert_close(analytic, _numeric_grad(of_one, x), rtol=1e-6, atol=1e-9)


def test_frozen_weight_and_hidden():
    hidden, weight, b, target = _inputs(9, 8, 12, torch.float32)
    h = hidden.clone().requires_grad_()
    loss = tgf.linear_cross_entropy(h, weight, target, b)
    loss.backward()
    ref = _reference(hidden, weight, b, target, "mean", torch.tensor(1.0, dtype=torch.float64))
    assert rel_err(h.grad, ref[1]) < TOL[torch.float32]
    w = weight.clone().requires_grad_()
    tgf.linear_cross_entropy(hidden, w, target).backward()
    ref = _reference(hidden, weight, None, target, "mean", torch.tensor(1.0, dtype=torch.float64))
    assert rel_err(w.grad, ref[2]) < TOL[torch.float32]
    with torch.no_grad():
        loss = tgf.linear_cross_entropy(hidden, w, target, b, reduction="sum")
    assert not loss.requires_grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_and_all_ignored_batches(reduction):
    _, weight, b, _ = _inputs(4, 8, 12, torch.float32)
    for n, target in [(0, torch.zeros(0, dtype=torch.long)), (4, torch.full((4,), -100))]:
        h = torch.randn(n, 8, requires_grad=True)
        w = weight.clone().requires_grad_()
        bl = b.clone().requires_grad_()
        got = tgf.linear_cross_entropy(h, w, target, bl, reduction=reduction)
        want = F.cross_entropy(F.linear(h.detach(), weight, b), target, reduction=reduction)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True)
        got.sum().backward()
        for leaf in (h, w, bl):
            assert leaf.grad.shape == leaf.shape and not leaf.grad.any()


def test_leading_dimensions_are_flattened():
    hidden, weight, b, target = _inputs(12, 8, 10, torch.float32)
    got = tgf.linear_cross_entropy(
        hidden.view(3, 4, 8), weight, target.view(3, 4), b, reduction="none"
    )
    assert got.shape == (3, 4)
    want = F.cross_entropy(F.linear(hidden, weight, b), target, reduction="none").view(3, 4)
    torch.testing.assert_close(got, want)


def test_autocast_casts_the_matmul_like_f_linear():
    hidden, weight, b, target = _inputs(9, 8, 12, torch.float32)
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tgf.linear_cross_entropy(hidden, w, target, b)
        want = F.cross_entropy(F.linear(hidden, weight, b).float(), target)
    got.backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_retain_graph():
    hidden, weight, _, target = _inputs(9, 8, 12, torch.float32)
    h = hidden.clone().requires_grad_()
    loss = tgf.linear_cross_entropy(h, weight, target, reduction="none")
    loss.sum().backward(retain_graph=True)
    loss.sum().backward()  # unreduced: recomputed from the saved inputs each time
    ref = _reference(
        hidden, weight, None, target, "none", torch.full((9,), 2.0, dtype=torch.float64)
    )
    assert rel_err(h.grad, ref[1]) < TOL[torch.float32]
    loss = tgf.linear_cross_entropy(h, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed by a first backward"):
        loss.backward()


def test_bad_inputs_raise_like_aten():
    hidden, weight, b, target = _inputs(6, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="avg is not a valid value for reduction"):
        tgf.linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(IndexError, match=r"Target 10 is out of bounds\."):
        tgf.linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 10, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"Expected input batch_size \(6\) to match target"):
        tgf.linear_cross_entropy(hidden, weight, target[:4])
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        tgf.linear_cross_entropy(hidden, weight[:, :5], target)
    with pytest.raises(RuntimeError, match="expected weight to have dtype"):
        tgf.linear_cross_entropy(hidden, weight.double(), target)
    # A bias of another shape gets the eager expression (F.linear's error here).
    with pytest.raises(RuntimeError, match="must match the existing size"):
        tgf.linear_cross_entropy(hidden, weight, target, b[:3])
    with pytest.raises(RuntimeError, match=r"expected bias of size \[10\], got \[3\]"):
        torch.ops.torchgraft.linear_cross_entropy(
            hidden, weight, target, b[:3], -100, 1, 0, [False, False, False]
        )
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        tgf.linear_cross_entropy(hidden, weight, target, chunk_size=0)


def test_runs_the_native_cpu_kernels():
    reset_stats()
    hidden, weight, b, target = _inputs(6, 8, 10, torch.bfloat16)
    h = hidden.clone().requires_grad_()
    tgf.linear_cross_entropy(h, weight, target, b).backward()
    tgf.linear_cross_entropy(h, weight, target, b, reduction="none").sum().backward()
    got = stats()
    assert got["native/torchgraft::linear_cross_entropy/CPU"]["calls"] == 2
    assert got["native/torchgraft::linear_cross_entropy_backward/CPU"]["calls"] == 1
    assert got["native/torchgraft::scale_grad_/CPU"]["calls"] == 3


def test_opcheck():
    hidden, weight, b, target = _inputs(6, 8, 10, torch.float32)
    args = (hidden.requires_grad_(), weight.requires_grad_(), target, b.requires_grad_())
    op = torch.ops.torchgraft.linear_cross_entropy
    torch.library.opcheck(op, (*args, -100, 1, 4, [True, True, True]))
    torch.library.opcheck(op, (*args, -100, 0, 0, [True, False, True]))
    back = torch.ops.torchgraft.linear_cross_entropy_backward
    go = torch.rand(6)
    plain = (hidden.detach(), weight.detach(), target, b.detach())
    torch.library.opcheck(back, (go, *plain, -100, 4, [True, True, False]))


@pytest.mark.compat
def test_compiles_fullgraph_without_graph_breaks():
    hidden, weight, b, target = _inputs(10, 8, 12, torch.float32)

    def step(h, w, bias):
        return tgf.linear_cross_entropy(torch.relu(h), w, target, bias, chunk_size=3) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    out = compiled(*a)
    out.backward()
    r = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    ref = step(*r)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for x, y in zip(a, r, strict=True):
        torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (13, 5, 1), (11, 3, 29), (40, 17, 9)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_odd_shapes_and_one_class(dtype, shape, reduction):
    """Sizes that are multiples of nothing, a single class (every loss 0), one row."""
    n, h, v = shape
    hidden, weight, b, target = _inputs(n, h, v, dtype, True, seed=n + v)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    loss = tgf.linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction)
    go = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    ref = _reference(hidden, weight, b, target, reduction, go)
    loss.backward(go.to(loss.dtype))
    scale = max(float(ref[0].detach().norm()), 1.0)
    assert float((loss.detach().double() - ref[0].detach()).norm()) / scale < TOL[dtype]
    for name, leaf, want in zip(["hidden", "weight", "bias"], leaves, ref[1:], strict=True):
        assert leaf.grad.shape == want.shape, name
        err = float((leaf.grad.double() - want).norm()) / max(float(want.norm()), 1e-3)
        assert err < TOL[dtype], name


@pytest.mark.parametrize("mask", [[a, b, c] for a in (0, 1) for b in (0, 1) for c in (0, 1)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_output_masks_of_the_op_and_its_backward(bias, mask):
    """Each gradient the mask asks for, and only those; the other outputs are empty."""
    mask = [bool(m) for m in mask]
    hidden, weight, b, target = _inputs(23, 10, 31, torch.float32, bias, seed=3)
    if not bias:
        b = None
    ref_sum = _reference(hidden, weight, b, target, "sum", torch.tensor(1.0, dtype=torch.float64))
    go = torch.rand(23, dtype=torch.float64) + 0.5
    ref_none = _reference(hidden, weight, b, target, "none", go)
    op = torch.ops.torchgraft.linear_cross_entropy
    loss, *grads = op(hidden, weight, target, b, -100, 2, 0, mask)
    back = torch.ops.torchgraft.linear_cross_entropy_backward(
        go.float(), hidden, weight, target, b, -100, 0, mask
    )
    assert rel_err(loss, ref_sum[0]) < TOL[torch.float32]
    for i, m in enumerate(mask):
        for g, want in ((grads[i], ref_sum[1 + i]), (back[i], ref_none[1 + i])):
            if m and want is not None:
                assert g.shape == want.shape and rel_err(g, want) < TOL[torch.float32]
            else:
                assert g.numel() == 0


def _matmuls(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::mm", "aten::addmm") for e in prof.events())


def test_the_scheme_switch_selects_the_scheme(scheme, monkeypatch):
    """Two passes over 8 groups x 8 blocks: 4 products per block (logits twice, d_hidden,
    d_weight) but for the last block's logits, which pass 1 leaves for pass 2; row chunks of 37
    rows: 3. (The switch that the other tests rely on works.)"""
    hidden, weight, b, target = _inputs(37, 24, 50, torch.float32, True)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    def step():
        tgf.linear_cross_entropy(h, w, target, b, chunk_size=37)

    count = _matmuls(step)
    if scheme == "two_pass":
        assert count == 8 * (8 * 4 - 1)
    else:
        assert count == 3
