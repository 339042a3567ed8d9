"""torchgraft.functional.rms_norm (torch.ops.torchgraft.rms_norm): the model variants' numerics,
gradients, odd sizes, layouts, errors, opcheck, compile (CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from torchgraft import functional as tgf
from torchgraft import reset_stats, stats
from torchgraft.ops.rms_norm.reference import (
    result_dtype,
    rms_norm_eager,
    rms_norm_reference,
)

pytestmark = pytest.mark.default_torch

# Relative-norm tolerances against the float64 reference: a few roundings of the output.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOL)
EPS = 1e-6
# (offset, cast_before_weight): Llama, OLMo2 (fp32 weight), Gemma, and both knobs at once.
MODES = [(0.0, True), (0.0, False), (1.0, False), (1.0, True)]
MODE_IDS = ["llama", "fp32-weight", "gemma", "offset+cast"]


def _x(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.3).to(dtype)


def _w(cols, dtype, offset, seed=1):
    # Around 1 in total (offset + weight), as trained weights are: it matters, never cancels.
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(cols, generator=gen, dtype=torch.float64) * 0.3 + 1 - offset).to(dtype)


def _weight_dtypes(dtype):
    """None, the input's dtype, and float32 under half precision (mixed precision)."""
    out = [None, dtype]
    if dtype in (torch.bfloat16, torch.float16):
        out.append(torch.float32)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (16, 1000), (2, 4097)])
@pytest.mark.parametrize(("offset", "cast"), MODES, ids=MODE_IDS)
def test_forward_and_backward_match_float64(dtype, shape, offset, cast):
    for wdtype in _weight_dtypes(dtype):
        if wdtype is None and offset:
            continue
        x = _x(shape, dtype).requires_grad_(True)
        w = None if wdtype is None else _w(shape[-1], wdtype, offset).requires_grad_(True)
        y = tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)
        out_dtype = result_dtype(dtype, wdtype, cast)
        assert y.dtype == out_dtype and y.shape == x.shape
        x64 = x.detach().double().requires_grad_(True)
        w64 = None if w is None else w.detach().double().requires_grad_(True)
        y64 = rms_norm_reference(x64, w64, EPS, offset, cast)
        dy = _x(shape, out_dtype, seed=2)
        y.backward(dy)
        y64.backward(dy.double())
        tol = TOL[dtype]
        # The output, and in the cast form xhat, are rounded: a rounding or two of x's dtype.
        assert rel_err(y, y64) < 2 * tol, wdtype
        assert x.grad.dtype == dtype
        # dx is a difference of terms of size ||dy * scale * rstd|| that cancel where rows are
        # short (one column: dx ~ 0): its error is measured against that size.
        h = x64.detach()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        scale = 1.0 if w is None else w64.detach() + offset
        terms = float((dy.double() * scale * rstd).norm())
        err = float((x.grad.double() - x64.grad).norm()) / max(float(x64.grad.norm()), terms)
        assert err < 4 * tol, wdtype
        if w is not None:
            assert w.grad.dtype == wdtype and w.grad.shape == w.shape
            assert rel_err(w.grad, w64.grad) < 4 * max(tol, TOL[wdtype]), wdtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("offset", "cast"), MODES[:3], ids=MODE_IDS[:3])
def test_the_model_expression_to_the_last_bit_but_for_rare_ties(dtype, offset, cast):
    # The kernel sums x^2 in another order than torch's mean: where that flips the last bit of
    # rstd, a half-precision output can move by one unit in the last place (rarely). float32
    # keeps more of those bits: a few units.
    x = _x((64, 1000), dtype)
    for wdtype in _weight_dtypes(dtype)[1:]:
        w = _w(1000, wdtype, offset)
        out = tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)
        ref = rms_norm_eager(x, w, EPS, offset, cast)
        assert out.dtype == ref.dtype
        ulp = torch.finfo(out.dtype).eps * ref.float().abs().clamp_min(1e-30)
        diff = (out.float() - ref.float()).abs()
        assert (diff <= (1 if dtype != torch.float32 else 4) * ulp).all(), wdtype
        if dtype != torch.float32:
            assert (out == ref).float().mean() > 0.995, wdtype


def test_llama_form_rounds_xhat_before_the_weight():
    # Regression: the cast form is not the fused one. In float16 with a weight far from 1 the
    # two roundings differ from one rounding on many elements.
    x, w = _x((32, 256), torch.float16), _w(256, torch.float16, 0.0) * 3
    llama = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    fused = tgf.rms_norm(x, w, EPS, cast_before_weight=False)
    assert torch.equal(llama, rms_norm_eager(x, w, EPS, 0.0, True))
    assert torch.equal(fused, rms_norm_eager(x, w, EPS, 0.0, False))
    assert (llama != fused).float().mean() > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_dw_sums_dy_times_the_rounded_xhat(dtype):
    # dw is the gradient of the forward as computed: dy * xhat.to(dtype) summed in float32
    # (then rounded once), against dy * xhat unrounded, which matches far fewer elements.
    rows, cols = 512, 64
    x, w = _x((rows, cols), dtype), _w(cols, dtype, 0.0).requires_grad_(True)
    dy = _x((rows, cols), dtype, seed=3)
    tgf.rms_norm(x, w, EPS, cast_before_weight=True).backward(dy)
    h = x.float()
    xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    rounded = (dy.double() * xhat.to(dtype).double()).sum(0).to(dtype)
    unrounded = (dy.double() * xhat.double()).sum(0).to(dtype)
    same_rounded = (w.grad == rounded).float().mean()
    assert same_rounded > 0.95
    assert same_rounded > (w.grad == unrounded).float().mean() + 0.2


GRADCHECK = [(o, c, True) for o, c in MODES] + [(0.0, True, False), (0.0, False, False)]


@pytest.mark.parametrize(("offset", "cast", "weighted"), GRADCHECK)
def test_gradcheck_float64(offset, cast, weighted):
    x = _x((4, 9), torch.float64).requires_grad_(True)
    w = _w(9, torch.float64, offset).requires_grad_(True) if weighted else None

    def f(x, w):
        return tgf.rms_norm(x, w, EPS, offset=offset, cast_before_weight=cast)

    assert torch.autograd.gradcheck(f, (x, w))


def test_gradcheck_mixed_dtypes_composite():
    # A float64 weight under a float32 input in the cast form: normalize, then multiply.
    x = _x((3, 5), torch.float32).requires_grad_(True)
    w = _w(5, torch.float64, 0.0).requires_grad_(True)
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    assert y.dtype == torch.float64
    assert torch.autograd.gradcheck(
        lambda w: tgf.rms_norm(x.detach(), w, EPS, cast_before_weight=True), (w,)
    )


def test_float32_weight_under_bfloat16_follows_the_model():
    x = _x((8, 64), torch.bfloat16).requires_grad_(True)
    w = _w(64, torch.float32, 0.0).requires_grad_(True)
    # Llama: a float32 result (the weight promotes), one normalization kernel then a multiply.
    reset_stats()
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    assert y.dtype == torch.float32
    assert stats()["native/torchgraft::rms_norm/CPU"]["calls"] == 1
    assert torch.equal(y, rms_norm_eager(x, w, EPS, 0.0, True))
    # Gemma / OLMo2: one kernel with the float32 weight, a bfloat16 result.
    g = tgf.rms_norm(x, w, EPS, offset=1.0)
    assert g.dtype == torch.bfloat16
    (g.float().sum() + y.sum()).backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5)])
def test_empty_inputs(shape):
    x = _x(shape, torch.float32).requires_grad_(True)
    w = _w(shape[-1], torch.float32, 0.0).requires_grad_(True)
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    assert y.shape == x.shape
    _, rstd = torch.ops.torchgraft.rms_norm(x, w, EPS, 0.0, True)
    assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32
    if shape[-1] == 0 and rstd.numel():
        assert rstd.isnan().all()  # the mean of an empty row, as F.rms_norm
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert (w.grad == 0).all()


def test_non_contiguous_inputs():
    base = _x((16, 48), torch.float32)
    x = base.t()[:, ::2]  # (48, 8), strided both ways
    w = _w(16, torch.float32, 0.0)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    y = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
    assert rel_err(y, rms_norm_reference(x, w, EPS)) < TOL[torch.float32]


def test_default_eps_is_the_accumulation_types_epsilon():
    x = _x((4, 16), torch.bfloat16)
    eps = torch.finfo(torch.float32).eps
    assert torch.equal(tgf.rms_norm(x), tgf.rms_norm(x, None, eps))


def test_runs_the_native_cpu_kernels_once_each_way():
    reset_stats()
    x = _x((8, 32), torch.bfloat16).requires_grad_(True)
    w = _w(32, torch.bfloat16, 0.0).requires_grad_(True)
    tgf.rms_norm(x, w, EPS, cast_before_weight=True).sum().backward()
    got = stats()
    assert got["native/torchgraft::rms_norm/CPU"]["calls"] == 1
    assert got["native/torchgraft::rms_norm_backward/CPU"]["calls"] == 1


def test_weight_gradient_is_deterministic_across_thread_counts():
    x = _x((300, 200), torch.float32)
    w = _w(200, torch.float32, 0.0).requires_grad_(True)
    dy = _x((300, 200), torch.float32, seed=5)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            w.grad = None
            tgf.rms_norm(x, w, EPS, cast_before_weight=True).backward(dy)
            grads.append(w.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


def test_calls_the_kernels_do_not_take_run_the_models_expression():
    x, w = _x((4, 8), torch.float32), _w(8, torch.float32, 0.0)
    for args in [
        (x.mul(8).long(), None),
        (x, w.mul(8).int()),
        (x[0, 0], None),
        (x, w[:1]),
    ]:
        torch.testing.assert_close(tgf.rms_norm(*args, EPS), rms_norm_eager(*args, EPS))
    with pytest.raises(RuntimeError, match="must match the size of tensor"):
        tgf.rms_norm(x, w[:4], EPS)
    with pytest.raises(ValueError, match="needs a weight"):
        tgf.rms_norm(x, None, EPS, offset=1.0)


def test_the_op_refuses_what_its_kernels_do_not_take():
    x, w = _x((4, 8), torch.float32), _w(8, torch.float32, 0.0)
    op = torch.ops.torchgraft.rms_norm
    with pytest.raises(RuntimeError, match="\"rms_norm\" not implemented for 'Long'"):
        op(x.long(), None, EPS, 0.0, False)
    with pytest.raises(RuntimeError, match="not implemented for 'Int'"):
        op(x, w.int(), EPS, 0.0, False)
    with pytest.raises(RuntimeError, match=r"Expected weight to be of same shape as normalized_sh"):
        op(x, w[:4], EPS, 0.0, False)
    with pytest.raises(RuntimeError, match=r"weight of shape \[2, 8\]"):
        op(x, w.expand(2, 8), EPS, 0.0, False)
    with pytest.raises(RuntimeError, match="at least 1 dimension"):
        op(x[0, 0], None, EPS, 0.0, False)
    # The op itself returns x's dtype: a weight that promotes it is the functional's business.
    with pytest.raises(RuntimeError, match="cast_before_weight"):
        op(x.bfloat16(), w, EPS, 0.0, True)


def test_backward_op_checks_its_arguments():
    x, w = _x((4, 8), torch.float32), _w(8, torch.float32, 0.0)
    _, rstd = torch.ops.torchgraft.rms_norm(x, w, EPS, 0.0, False)
    bwd = torch.ops.torchgraft.rms_norm_backward
    with pytest.raises(RuntimeError, match="does not match input"):
        bwd(x[:2], x, rstd, w, 0.0, False, [True, True])
    with pytest.raises(RuntimeError, match="one per normalized row"):
        bwd(x, x, rstd[:2], w, 0.0, False, [True, True])
    dx, dw = bwd(x, x, rstd, w, 0.0, False, [True, False])
    assert dx.shape == x.shape and dw.numel() == 0
    dx, dw = bwd(x, x, rstd, w, 0.0, False, [False, True])
    assert dx.numel() == 0 and dw.shape == w.shape


def test_fake_functions_raise_what_the_kernels_raise():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = _x((4, 8), torch.float32), _w(8, torch.float32, 0.0)
    cases = [(x.long(), None, False), (x, w[:4], False), (x[0, 0], None, False)]
    cases.append((x.bfloat16(), w, True))
    for xi, wi, cast in cases:
        with pytest.raises(RuntimeError) as real:
            torch.ops.torchgraft.rms_norm(xi, wi, EPS, 0.0, cast)
        with FakeTensorMode() as mode:
            fx = mode.from_tensor(xi)
            fw = None if wi is None else mode.from_tensor(wi)
            with pytest.raises(RuntimeError) as fake:
                torch.ops.torchgraft.rms_norm(fx, fw, EPS, 0.0, cast)
        assert str(real.value).splitlines()[0] in str(fake.value), (real.value, fake.value)


@pytest.mark.parametrize(("offset", "cast"), MODES, ids=MODE_IDS)
def test_opcheck(offset, cast):
    x = _x((5, 6), torch.float32).requires_grad_(True)
    w = _w(6, torch.float32, offset).requires_grad_(True)
    torch.library.opcheck(torch.ops.torchgraft.rms_norm, (x, w, EPS, offset, cast))
    torch.library.opcheck(torch.ops.torchgraft.rms_norm, (x, None, EPS, 0.0, cast))
    _, rstd = torch.ops.torchgraft.rms_norm(x.detach(), w.detach(), EPS, offset, cast)
    dy = _x((5, 6), torch.float32, seed=4)
    for mask in ([True, True], [True, False], [False, True]):
        args = (dy, x.detach(), rstd, w.detach(), offset, cast, mask)
        torch.library.opcheck(torch.ops.torchgraft.rms_norm_backward, args)


def test_compiles_fullgraph_without_graph_breaks():
    def block(x, w, g):
        a = tgf.rms_norm(x, w, EPS, cast_before_weight=True)
        b = tgf.rms_norm(x, g, EPS, offset=1.0)
        return (a * b).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = _x((6, 10), torch.bfloat16).requires_grad_(True)
    w = _w(10, torch.bfloat16, 0.0).requires_grad_(True)
    g = _w(10, torch.float32, 1.0).requires_grad_(True)
    out = compiled(x, w, g)
    out.backward()
    grads = [t.grad.clone() for t in (x, w, g)]
    for t in (x, w, g):
        t.grad = None
    ref = block(x, w, g)
    ref.backward()
    assert torch.equal(out, ref)
    for got, t in zip(grads, (x, w, g), strict=True):
        assert torch.equal(got, t.grad)
