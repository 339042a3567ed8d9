"""torchgraft.functional.cross_entropy: values, gradients, in place, errors, compile (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.cross_entropy.reference import cross_entropy_reference

pytestmark = pytest.mark.default_torch


# Gradient tolerances against float64 (relative norm): rounded once to the dtype, and once more
# when scaled by the upstream gradient.
@pytest.fixture(autouse=True)
def _own_rng():
    """Seeded random numbers that leave the global generator as they found it (the tests
    after these ones see the same random inputs with or without them)."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(0)
        yield


GRAD_TOL = {torch.float64: 1e-12, torch.float32: 3e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# The loss is computed in float32 (float64 for float64) from the same rounded logits.
LOSS_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
DTYPES = list(GRAD_TOL)
REDUCTIONS = ["mean", "sum", "none"]


def _inputs(shape, dtype, ignore_every=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    vocab = shape[-1]
    target = torch.randint(0, vocab, shape[:-1], generator=g)
    flat = target.view(-1)
    if ignore_every:
        flat[1::ignore_every] = -100
    return logits, target


def _reference(logits, target, reduction, label_smoothing, grad_output):
    x = logits.detach().double().requires_grad_()
    loss = cross_entropy_reference(x, target, -100, reduction, label_smoothing)
    loss.backward(grad_output.double())
    return loss, x.grad


def _upstream(loss_shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(loss_shape, generator=g, dtype=torch.float64) + 0.5


@pytest.mark.parametrize("inplace", [False, True], ids=["new_grad", "inplace"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (2, 3, 129), (33, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_and_gradient_match_float64(dtype, shape, reduction, label_smoothing, inplace):
    base, target = _inputs(shape, dtype)
    leaf = base.clone().requires_grad_()
    logits = leaf * 1 if inplace else leaf  # in place needs a non-leaf the caller owns
    loss = tgf.cross_entropy(
        logits,
        target,
        reduction=reduction,
        label_smoothing=label_smoothing,
        inplace_backward=inplace,
    )
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == want_dtype
    go = _upstream(loss.shape)
    ref_loss, ref_grad = _reference(base, target, reduction, label_smoothing, go)
    assert loss.shape == ref_loss.shape
    loss.backward(go.to(loss.dtype))
    assert leaf.grad.dtype == dtype and leaf.grad.shape == base.shape
    # A single class with smoothing has a zero loss and gradient: compare against ones then.
    scale = max(ref_loss.norm().item(), 1.0)
    assert (loss.double() - ref_loss).norm().item() / scale < LOSS_TOL[dtype]
    gscale = max(ref_grad.norm().item(), go.norm().item() / max(target.numel(), 1))
    assert (leaf.grad.double() - ref_grad).norm().item() / gscale < GRAD_TOL[dtype]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_gradcheck_float64(reduction, label_smoothing):
    logits, target = _inputs((5, 7), torch.float64)
    x = logits.requires_grad_()

    def loss(x):
        return tgf.cross_entropy(x, target, reduction=reduction, label_smoothing=label_smoothing)

    # (The in-place path cannot run gradcheck, which backpropagates through one graph several
    # times; its float64 results are compared with the reference above at 1e-12.)
    assert torch.autograd.gradcheck(loss, (x,))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_and_empty_batches_follow_aten(reduction):
    logits = torch.randn(4, 6, requires_grad=True)
    target = torch.full((4,), -100)
    for x, t in [(logits, target), (torch.randn(0, 6, requires_grad=True), target[:0])]:
        got = tgf.cross_entropy(x, t, reduction=reduction)
        want = F.cross_entropy(x.detach(), t, reduction=reduction)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True)
        got.sum().backward()
        assert x.grad.shape == x.shape and not x.grad.any()
    smoothed = tgf.cross_entropy(logits, target, reduction=reduction, label_smoothing=0.2)
    want = F.cross_entropy(logits.detach(), target, reduction=reduction, label_smoothing=0.2)
    torch.testing.assert_close(smoothed, want, equal_nan=True)


def test_ignore_index_may_be_a_class():
    logits, _ = _inputs((6, 5), torch.float32)
    target = torch.tensor([0, 1, 2, 3, 4, 0])
    got = tgf.cross_entropy(logits, target, ignore_index=0)
    want = F.cross_entropy(logits, target, ignore_index=0)
    torch.testing.assert_close(got, want)


def test_uint8_targets_and_1d_logits():
    logits, target = _inputs((6, 5), torch.float32, ignore_every=0)
    got = tgf.cross_entropy(logits, target.to(torch.uint8))
    torch.testing.assert_close(got, F.cross_entropy(logits, target))
    one = tgf.cross_entropy(logits[0], target[0], reduction="none")
    assert one.shape == ()
    torch.testing.assert_close(one, F.cross_entropy(logits[0], target[0], reduction="none"))


def test_nan_and_masked_logits():
    logits, target = _inputs((4, 9), torch.float32, ignore_every=0)
    logits[0, 3] = float("nan")
    logits[1, :5] = float("-inf")  # a mask, as language models use
    target[1] = 7
    got = tgf.cross_entropy(logits, target, reduction="none")
    want = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(got, want, equal_nan=True)


def test_inplace_writes_the_gradient_into_the_logits_buffer():
    base, target = _inputs((8, 33), torch.bfloat16)
    leaf = base.clone().requires_grad_()
    logits = leaf * 1
    buffer = logits.data_ptr()
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    loss = tgf.cross_entropy(logits, target, inplace_backward=True)
    assert not torch.equal(logits.detach(), base)  # already the gradient
    loss.backward()
    assert seen == [buffer]
    _, ref_grad = _reference(base, target, "mean", 0.0, torch.tensor(1.0))
    assert rel_err(leaf.grad, ref_grad) < GRAD_TOL[torch.bfloat16]


def test_inplace_is_refused_or_detected_where_unsafe():
    base, target = _inputs((4, 6), torch.float32)
    leaf = base.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        tgf.cross_entropy(leaf, target, inplace_backward=True)
    # tanh saves its output for its backward: overwriting it must make that backward fail
    # loudly, not compute a wrong gradient.
    loss = tgf.cross_entropy(torch.tanh(leaf), target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # A second backward through the graph raises instead of reusing a consumed buffer.
    loss = tgf.cross_entropy(leaf * 1, target, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed by a first backward"):
        loss.backward()


def test_inplace_falls_back_for_non_contiguous_logits():
    base, target = _inputs((6, 10), torch.float32)
    leaf = base.t().contiguous().requires_grad_()
    logits = (leaf * 1).t()
    assert not logits.is_contiguous()
    kept = logits.detach().clone()
    tgf.cross_entropy(logits, target, inplace_backward=True).backward()
    assert torch.equal(logits.detach(), kept)
    _, ref_grad = _reference(base, target, "mean", 0.0, torch.tensor(1.0))
    assert rel_err(leaf.grad.t(), ref_grad) < GRAD_TOL[torch.float32]


def test_functional_backward_supports_retain_graph():
    base, target = _inputs((5, 8), torch.float32)
    x = base.clone().requires_grad_()
    loss = tgf.cross_entropy(x, target, reduction="sum")
    loss.backward(torch.tensor(2.0), retain_graph=True)
    loss.backward(torch.tensor(3.0), retain_graph=True)
    # An upstream gradient of exactly 1 hands out the saved gradient itself: still correct.
    loss.backward(retain_graph=True)
    loss.backward()
    _, ref_grad = _reference(base, target, "sum", 0.0, torch.tensor(7.0))
    assert rel_err(x.grad, ref_grad) < GRAD_TOL[torch.float32]


def test_no_gradient_work_without_autograd():
    base, target = _inputs((5, 8), torch.float32)
    x = base.clone().requires_grad_()
    with torch.no_grad():
        loss = tgf.cross_entropy(x, target, inplace_backward=True)
    assert torch.equal(x.detach(), base)  # not overwritten: no gradient was wanted
    torch.testing.assert_close(loss, F.cross_entropy(base, target))


def test_bad_inputs_raise_like_aten():
    logits, target = _inputs((4, 5), torch.float32, ignore_every=0)
    with pytest.raises(ValueError, match="avg is not a valid value for reduction"):
        tgf.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(IndexError, match=r"Target 5 is out of bounds\."):
        tgf.cross_entropy(logits, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(IndexError, match=r"Target -3 is out of bounds\."):
        tgf.cross_entropy(logits, torch.tensor([0, 1, -3, 2]))
    with pytest.raises(ValueError, match=r"Expected input batch_size \(4\) to match target"):
        tgf.cross_entropy(logits, target[:3])
    with pytest.raises(RuntimeError, match="expected target dtype to be Long or Byte"):
        tgf.cross_entropy(logits, target.int())
    with pytest.raises(RuntimeError, match=r"label_smoothing must be between 0\.0 and 1\.0"):
        tgf.cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
        tgf.cross_entropy(logits.long(), target)
    # Negative smoothing means none, as in ATen.
    torch.testing.assert_close(
        tgf.cross_entropy(logits, target, label_smoothing=-0.5), F.cross_entropy(logits, target)
    )
    # The logits are untouched by a failed in-place call.
    x = logits.clone().requires_grad_()
    y = x * 1
    with pytest.raises(IndexError):
        tgf.cross_entropy(y, torch.tensor([0, 1, 9, 2]), inplace_backward=True)
    assert torch.equal(y.detach(), logits)


def test_runs_the_native_cpu_kernels():
    reset_stats()
    logits, target = _inputs((4, 8), torch.bfloat16)
    x = logits.clone().requires_grad_()
    tgf.cross_entropy(x, target).backward()  # an upstream gradient of 1: nothing to scale
    tgf.cross_entropy(x, target).backward(torch.tensor(2.0))
    tgf.cross_entropy(x * 1, target, inplace_backward=True).backward()
    got = stats()
    assert got["native/torchgraft::cross_entropy/CPU"]["calls"] == 2
    assert got["native/torchgraft::scale_grad/CPU"]["calls"] == 1
    assert got["native/torchgraft::cross_entropy_/CPU"]["calls"] == 1
    assert got["native/torchgraft::scale_grad_/CPU"]["calls"] == 1


def test_scale_grad_ops():
    g = torch.randn(6, 10, dtype=torch.bfloat16)
    go_rows = torch.tensor([1.0, 2.0, -0.5, 1.0, 0.0, 3.0])
    out = torch.ops.torchgraft.scale_grad(g, go_rows)
    torch.testing.assert_close(out, (g.float() * go_rows[:, None]).to(g.dtype))
    inplace = g.clone()
    torch.ops.torchgraft.scale_grad_(inplace, go_rows)
    assert torch.equal(inplace, out)
    with pytest.raises(RuntimeError, match="does not fit a gradient"):
        torch.ops.torchgraft.scale_grad(g, torch.ones(5))


def test_opcheck():
    logits, target = _inputs((5, 6), torch.float32)
    x = logits.requires_grad_()
    torch.library.opcheck(torch.ops.torchgraft.cross_entropy, (x, target, -100, 1, 0.1, True))
    torch.library.opcheck(torch.ops.torchgraft.cross_entropy, (x, target, -100, 0, 0.0, False))
    torch.library.opcheck(
        torch.ops.torchgraft.cross_entropy_, (logits.detach().clone(), target, -100, 2, 0.0)
    )
    g = torch.randn(5, 6)
    torch.library.opcheck(torch.ops.torchgraft.scale_grad, (g, torch.tensor(0.5)))
    torch.library.opcheck(torch.ops.torchgraft.scale_grad_, (g.clone(), torch.rand(5)))


@pytest.mark.parametrize("inplace", [False, True], ids=["new_grad", "inplace"])
def test_compiles_fullgraph_without_graph_breaks(inplace):
    base, target = _inputs((6, 10), torch.float32)
    weight = torch.randn(10, 10)

    def step(x, w):
        logits = x @ w
        return tgf.cross_entropy(logits, target, label_smoothing=0.1, inplace_backward=inplace)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x1, w1 = base.clone().requires_grad_(), weight.clone().requires_grad_()
    out = compiled(x1, w1)
    out.backward()
    x2, w2 = base.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = step(x2, w2)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
