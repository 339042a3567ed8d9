"""The native LayerNorm grafts on CUDA: hidden sizes through every kernel path (rows in
registers, vector and scalar; the loop kernels), every dtype, parameters present or absent,
output masks, against float64 and ATen's CUDA kernels; deterministic dw / db; errors; autograd
and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.grafts.layer_norm.reference import (
    layer_norm_backward_reference,
    layer_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 8e-3, torch.float16: 1e-3}
A = torch.ops.aten
FWD, BWD = "native/aten::native_layer_norm/CUDA", "native/aten::native_layer_norm_backward/CUDA"
HIDDEN = [1, 7, 64, 768, 1000, 2056, 4096, 5120, 8192, 16384, 16387, 32768, 65536]


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def calls(key):
    return torchgraft.stats()[key]["calls"]


def rel_err(out, ref, scale=0.0):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / max(ref.norm().item(), scale, 1e-300)).item()


def randn(*shape, dtype=torch.float32, scale=1.0, shift=0.0, offset=0):
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + offset, device="cuda", dtype=torch.float64) * scale + shift
    return flat[offset:].view(*shape).to(dtype)


def poison_allocator(shape, dtype):
    torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def check(x, ns, w, b, dtype, mask=(True, True, True)):
    dy = randn(*x.shape, dtype=dtype)
    with torchgraft.enabled():
        poison_allocator(x.shape, dtype)
        y, mean, rstd = A.native_layer_norm(x, ns, w, b, 1e-5)
        poison_allocator(x.shape, dtype)
        dx, dw, db = A.native_layer_norm_backward(dy, x, ns, mean, rstd, w, b, list(mask))
    torch.cuda.synchronize()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert y.dtype == dtype and mean.dtype == acc and rstd.dtype == acc
    y_ref, m_ref, r_ref = layer_norm_reference(x, ns, w, b, 1e-5)
    assert rel_err(y, y_ref) < TOL[dtype]
    # A row's mean is a sum of its values: its rounding scales with their size (the row's RMS),
    # not with the mean, which can be near zero.
    rms = x.double().pow(2).mean(dim=tuple(range(x.dim() - len(ns), x.dim()))).sqrt()
    assert rel_err(mean, m_ref, rms.norm().item()) < 1e-6 and rel_err(rstd, r_ref) < 1e-5
    dx_ref, dw_ref, db_ref = layer_norm_backward_reference(dy, x, ns, mean, rstd, w)
    if mask[0]:
        terms = (dy.double() * rstd.double()).norm().item()
        assert rel_err(dx, dx_ref, terms) < 4 * TOL[dtype]
    if mask[1] and w is not None:
        assert dw.dtype == dtype and rel_err(dw, dw_ref) < 4 * TOL[dtype]
    if mask[2] and b is not None:
        assert db.dtype == dtype and rel_err(db, db_ref) < 4 * TOL[dtype]
    return y, dx, dw, db


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_hidden_sizes(dtype, hidden):
    rows = max(1, min(257, (1 << 21) // hidden))
    x = randn(rows, hidden, dtype=dtype, scale=2.0, shift=1.0)
    w = randn(hidden, dtype=dtype, scale=0.3, shift=1.0)
    b = randn(hidden, dtype=dtype, scale=0.3)
    check(x, [hidden], w, b, dtype)
    assert calls(FWD) == 1 and calls(BWD) == 1


@pytest.mark.parametrize("params", ["weight", "none"])
@pytest.mark.parametrize("mask", [(True, False, False), (False, True, True), (True, True, False)])
def test_parameters_and_masks(params, mask):
    x = randn(300, 1024, dtype=torch.bfloat16, shift=1.0)
    w = randn(1024, dtype=torch.bfloat16, shift=1.0) if params == "weight" else None
    b = randn(1024, dtype=torch.bfloat16) if params == "weight" else None
    if w is None:
        mask = (True, False, False)
    check(x, [1024], w, b, torch.bfloat16, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_and_odd_take_the_scalar_kernels(dtype):
    x = randn(33, 4099, dtype=dtype, offset=1)
    w = randn(4099, dtype=dtype, shift=1.0, offset=1)
    check(x, [4099], w, randn(4099, dtype=dtype), dtype)
    x = randn(17, 1024, dtype=dtype, offset=3)
    check(x, [1024], None, None, dtype, (True, False, False))


# 4096: the staged forward and the rows backward; 8192: the bulk backward (clusters).
@pytest.mark.parametrize("hidden", [4096, 8192])
def test_close_to_aten_and_deterministic(hidden):
    x = randn(8192, hidden, dtype=torch.bfloat16, shift=1.0)
    w, b = randn(hidden, dtype=torch.bfloat16, shift=1.0), randn(hidden, dtype=torch.bfloat16)
    dy = randn(8192, hidden, dtype=torch.bfloat16)
    ns = [hidden]
    want = A.native_layer_norm(x, ns, w, b, 1e-5)
    want_b = A.native_layer_norm_backward(dy, x, ns, want[1], want[2], w, b, [True] * 3)
    with torchgraft.enabled():
        got = A.native_layer_norm(x, ns, w, b, 1e-5)
        got_b = A.native_layer_norm_backward(dy, x, ns, want[1], want[2], w, b, [True] * 3)
        again = A.native_layer_norm_backward(dy, x, ns, want[1], want[2], w, b, [True] * 3)
    assert rel_err(got[0], want[0]) < 8e-3 and rel_err(got[1], want[1]) < 1e-6
    for g, t in zip(got_b, want_b, strict=True):
        assert rel_err(g, t) < 1e-2
    for g, a in zip(got_b, again, strict=True):
        assert torch.equal(g, a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [4096, 40000])
def test_non_finite_rows_like_aten(dtype, hidden):
    # Rows kernel (16-bit: one reduction of sums shifted by the row's first element) and loop
    # kernel: an infinity or NaN anywhere in a row, the first element included, makes the row's
    # output NaN as in ATen; the other rows stay exact.
    x = randn(6, hidden, dtype=dtype, shift=1.0)
    x[1, 0] = float("inf")
    x[2, 7] = float("inf")
    x[3, 5], x[3, 9] = float("-inf"), float("inf")
    x[4, 3] = float("nan")
    w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
    want = A.native_layer_norm(x, [hidden], w, b, 1e-5)
    with torchgraft.enabled():
        got = A.native_layer_norm(x, [hidden], w, b, 1e-5)
    assert calls(FWD) == 1
    assert torch.equal(got[0].isnan(), want[0].isnan())
    assert torch.equal(got[0].isinf(), want[0].isinf())
    for g, t in zip(got[1:], want[1:], strict=True):
        assert torch.equal(g.isfinite(), t.isfinite())
    finite = [0, 5]
    for g, t in zip(got, want, strict=True):
        assert rel_err(g[finite], t[finite]) < TOL[dtype]


def test_layouts_empty_and_multi_dim_shapes():
    cases = [
        (randn(40, 6, shift=1.0).t(), [40]),
        (randn(2, 3, 4, 5).to(memory_format=torch.channels_last), [5]),
        (randn(2, 3, 4, 5), [4, 5]),
        (torch.empty(0, 8, device="cuda"), [8]),
        (torch.empty(3, 0, device="cuda"), [0]),
    ]
    for x, ns in cases:
        w = randn(*ns) if x.numel() else None
        want = A.native_layer_norm(x, ns, w, None, 1e-5)
        with torchgraft.enabled():
            got = A.native_layer_norm(x, ns, w, None, 1e-5)
        for g, t in zip(got, want, strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype and g.stride() == t.stride()
            if x.shape[0]:
                assert torch.allclose(g, t, rtol=1e-5, atol=1e-5, equal_nan=True)
        mask = [True, w is not None, False]
        want_b = A.native_layer_norm_backward(x, x, ns, want[1], want[2], w, None, mask)
        with torchgraft.enabled():
            got_b = A.native_layer_norm_backward(x, x, ns, want[1], want[2], w, None, mask)
        for g, t in zip(got_b, want_b, strict=True):
            assert (g is None) == (t is None)
            if g is not None:
                assert g.shape == t.shape and torch.allclose(g, t, rtol=1e-4, atol=1e-5)


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


ERROR_CASES = {
    "bad_shape": lambda: A.native_layer_norm(randn(3, 4, 8), [5], None, None, 1e-5),
    "bad_weight": lambda: A.native_layer_norm(randn(3, 8), [8], randn(7), None, 1e-5),
    "long": lambda: A.native_layer_norm(
        torch.arange(8, device="cuda").view(1, 8), [8], None, None, 1e-5
    ),
    "mixed": lambda: A.native_layer_norm(
        randn(3, 8, dtype=torch.bfloat16), [8], randn(8), None, 1e-5
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_like_aten(case):
    theirs = _error_of(ERROR_CASES[case])
    with torchgraft.enabled():
        ours = _error_of(ERROR_CASES[case])
    assert issubclass(ours[0], RuntimeError)
    assert ours[1] == theirs[1], (ours, theirs)


def test_module_autograd_gradcheck_and_compile():
    norm = torch.nn.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(randn(4096, dtype=torch.bfloat16, scale=0.3, shift=1.0))
        norm.bias.copy_(randn(4096, dtype=torch.bfloat16, scale=0.3))
    x = randn(64, 4096, dtype=torch.bfloat16, shift=1.0).requires_grad_()
    # A random weighting: with unit weight and zero bias, sum(norm(x) ** 2) is constant in x and
    # its gradients are rounding noise.
    c = randn(64, 4096)

    def loss(t):
        return (norm(t).float() * c).sum()

    params = (x, norm.weight, norm.bias)
    want = torch.autograd.grad(loss(x), params)
    with torchgraft.enabled():
        got = torch.autograd.grad(loss(x), params)
        xd = torch.randn(3, 4, 5, dtype=torch.float64, device="cuda", requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: F.layer_norm(t, [5]), (xd,))
        compiled = torch.compile(loss, backend="aot_eager")
        got_c = torch.autograd.grad(compiled(x), params)
    assert calls(FWD) >= 2 and calls(BWD) >= 2
    for g, w, c in zip(got, want, got_c, strict=True):
        assert rel_err(g, w) < 2e-2 and torch.equal(g, c)
