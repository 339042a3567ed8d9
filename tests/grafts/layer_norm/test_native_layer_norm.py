"""The native LayerNorm grafts on CPU: numerics against float64 and ATen, parameters present or
absent, mixed dtypes, output masks, mean/rstd dtypes and shapes, layouts, empty inputs, ATen's
errors, autograd (nn.LayerNorm), torch.compile, counters and control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.cli import list_rows
from torchgraft.grafts.layer_norm.reference import (
    layer_norm_backward_reference,
    layer_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 8e-3, torch.float16: 1e-3}
A = torch.ops.aten
FWD, BWD = "native/aten::native_layer_norm/CPU", "native/aten::native_layer_norm_backward/CPU"


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def calls(key: str) -> int:
    return torchgraft.stats()[key]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / max(ref.norm().item(), scale, 1e-300)).item()


def randn(*shape: int, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + shift).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("shape", "normalized"),
    [((8, 64), 1), ((2, 3, 100), 1), ((4, 7, 33), 2), ((5,), 1), ((3, 4097), 1), ((6, 1), 1)],
)
@pytest.mark.parametrize("params", ["both", "weight", "none"])
def test_forward_and_backward_match_float64(dtype, shape, normalized, params):
    ns = list(shape[-normalized:])
    x = randn(*shape, dtype=dtype, scale=2.0, shift=3.0)
    w = randn(*ns, dtype=dtype, scale=0.3, shift=1.0) if params != "none" else None
    b = randn(*ns, dtype=dtype, scale=0.5) if params == "both" else None
    with torchgraft.enabled():
        y, mean, rstd = A.native_layer_norm(x, ns, w, b, 1e-5)
    assert calls(FWD) == 1
    y_ref, m_ref, r_ref = layer_norm_reference(x, ns, w, b, 1e-5)
    # ATen's CPU layout and dtypes: y contiguous like x; mean and rstd in x's dtype (no mixed
    # parameters here), shaped like the batch dims then ones.
    assert y.dtype == dtype and y.is_contiguous() and y.shape == x.shape
    stat = (*shape[: len(shape) - normalized], *([1] * normalized))
    for t in (mean, rstd):
        assert t.dtype == dtype and t.shape == stat and t.is_contiguous()
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(mean, m_ref) < TOL[dtype] and rel_err(rstd, r_ref) < max(TOL[dtype], 1e-5)

    dy = randn(*shape, dtype=dtype)
    mask = [True, params != "none", params == "both"]
    with torchgraft.enabled():
        dx, dw, db = A.native_layer_norm_backward(dy, x, ns, mean, rstd, w, b, mask)
    assert calls(BWD) == 1
    dx_ref, dw_ref, db_ref = layer_norm_backward_reference(dy, x, ns, mean, rstd, w)
    terms = (dy.double() * rstd.double()).norm().item()
    assert dx.dtype == dtype and rel_err(dx, dx_ref, terms) < 4 * TOL[dtype]
    if mask[1]:
        assert dw.dtype == dtype and dw.shape == w.shape
        assert rel_err(dw, dw_ref) < 4 * TOL[dtype]
    else:
        assert dw is None
    if mask[2]:
        assert db.dtype == dtype and db.shape == b.shape
        assert rel_err(db, db_ref) < 4 * TOL[dtype]
    else:
        assert db is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_dtype_like_aten(dtype):
    # A 16-bit input with float32 parameters: mean and rstd in float32, dw and db float32.
    x = randn(16, 96, dtype=dtype, shift=2.0)
    w, b = randn(96, shift=1.0), randn(96)
    want = A.native_layer_norm(x, [96], w, b, 1e-5)
    with torchgraft.enabled():
        got = A.native_layer_norm(x, [96], w, b, 1e-5)
    for g, t in zip(got, want, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape and g.stride() == t.stride()
    assert got[1].dtype == torch.float32
    assert rel_err(got[0], want[0]) < TOL[dtype]
    dy = randn(16, 96, dtype=dtype)
    want_b = A.native_layer_norm_backward(dy, x, [96], want[1], want[2], w, b, [True] * 3)
    with torchgraft.enabled():
        got_b = A.native_layer_norm_backward(dy, x, [96], got[1], got[2], w, b, [True] * 3)
    for g, t in zip(got_b, want_b, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
    # dw and db accumulate in float32 (ATen's CPU kernel, some versions, rounds its partial sums
    # to the input's dtype: compare with float64, not with it).
    _, dw_ref, db_ref = layer_norm_backward_reference(dy, x, [96], got[1], got[2], w)
    assert rel_err(got_b[1], dw_ref) < 1e-5 and rel_err(got_b[2], db_ref) < 1e-5
    assert rel_err(got_b[0], want_b[0]) < TOL[dtype]


def test_close_to_aten_and_layouts():
    for x in (
        randn(40, 6, shift=1.0).t(),
        randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        randn(1, 33).expand(4, 33),
        randn(5, 80)[:, ::2],
    ):
        ns = [x.shape[-1]]
        w, b = randn(*ns), randn(*ns)
        want = A.native_layer_norm(x, ns, w, b, 1e-5)
        with torchgraft.enabled():
            got = A.native_layer_norm(x, ns, w, b, 1e-5)
        for g, t in zip(got, want, strict=True):
            assert g.stride() == t.stride() and g.dtype == t.dtype
            assert torch.allclose(g, t, rtol=1e-5, atol=1e-5)
        dy = torch.randn_like(x)
        want_b = A.native_layer_norm_backward(dy, x, ns, want[1], want[2], w, b, [True] * 3)
        with torchgraft.enabled():
            got_b = A.native_layer_norm_backward(dy, x, ns, want[1], want[2], w, b, [True] * 3)
        for g, t in zip(got_b, want_b, strict=True):
            assert g.stride() == t.stride()
            assert torch.allclose(g, t, rtol=1e-4, atol=1e-5)


def test_empty_inputs_like_aten():
    w, b = randn(8), randn(8)
    for x in (torch.empty(0, 8), torch.empty(3, 0)):
        ns = [x.shape[-1]]
        wx, bx = (w, b) if ns == [8] else (None, None)
        want = A.native_layer_norm(x, ns, wx, bx, 1e-5)
        with torchgraft.enabled():
            got = A.native_layer_norm(x, ns, wx, bx, 1e-5)
        for g, t in zip(got, want, strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype
            assert torch.equal(g.isnan(), t.isnan()) and torch.equal(g.nan_to_num(), t.nan_to_num())
        mask = [True, wx is not None, bx is not None]
        want_b = A.native_layer_norm_backward(x, x, ns, want[1], want[2], wx, bx, mask)
        with torchgraft.enabled():
            got_b = A.native_layer_norm_backward(x, x, ns, want[1], want[2], wx, bx, mask)
        for g, t in zip(got_b, want_b, strict=True):
            assert (g is None) == (t is None)
            if g is not None:
                assert g.shape == t.shape and g.dtype == t.dtype
                if x.numel() == 0 and g.numel() and x.shape[0] == 0:
                    assert torch.equal(g, t)  # zeros: no rows


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


ERROR_CASES = {
    "empty_shape": lambda: A.native_layer_norm(randn(3, 4), [], None, None, 1e-5),
    "bad_shape": lambda: A.native_layer_norm(randn(3, 4, 8), [5], None, None, 1e-5),
    "bad_weight": lambda: A.native_layer_norm(randn(3, 8), [8], randn(7), None, 1e-5),
    "bad_bias": lambda: A.native_layer_norm(randn(3, 8), [8], None, randn(7), 1e-5),
    "long": lambda: A.native_layer_norm(torch.arange(8).view(1, 8), [8], None, None, 1e-5),
    "long_empty": lambda: A.native_layer_norm(
        torch.empty(0, 8, dtype=torch.long), [8], None, None, 1e-5
    ),
    "weight_f64": lambda: A.native_layer_norm(randn(3, 8), [8], randn(8).double(), None, 1e-5),
    "f64_weight_f32": lambda: A.native_layer_norm(randn(3, 8).double(), [8], randn(8), None, 1e-5),
    "bf16_weight_f16": lambda: A.native_layer_norm(
        randn(3, 8, dtype=torch.bfloat16), [8], randn(8).half(), None, 1e-5
    ),
    "complex": lambda: A.native_layer_norm(
        torch.randn(2, 4, dtype=torch.complex64), [4], None, None, 1e-5
    ),
    "bwd_mean_dtype": lambda: A.native_layer_norm_backward(
        randn(3, 8), randn(3, 8), [8], randn(3, 1).double(), randn(3, 1), None, None, [True] * 3
    ),
    "bwd_grad_dtype": lambda: A.native_layer_norm_backward(
        randn(3, 8, dtype=torch.bfloat16),
        randn(3, 8),
        [8],
        randn(3, 1),
        randn(3, 1),
        None,
        None,
        [True, False, False],
    ),
    "bwd_missing_weight": lambda: A.native_layer_norm_backward(
        randn(3, 8), randn(3, 8), [8], randn(3, 1), randn(3, 1), None, None, [True, True, False]
    ),
    "bwd_long": lambda: A.native_layer_norm_backward(
        torch.ones(2, 8, dtype=torch.long),
        torch.ones(2, 8, dtype=torch.long),
        [8],
        torch.ones(2, 1),
        torch.ones(2, 1),
        None,
        None,
        [True, False, False],
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_like_aten(case):
    theirs = _error_of(ERROR_CASES[case])
    with torchgraft.enabled():
        ours = _error_of(ERROR_CASES[case])
    assert issubclass(ours[0], RuntimeError)
    assert ours[1] == theirs[1], (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_module_training_hits_both_kernels(dtype):
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(256, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(256, dtype=dtype, shift=1.0, scale=0.3))
        norm.bias.copy_(randn(256, dtype=dtype, scale=0.3))
    x = randn(4, 16, 256, dtype=dtype, shift=1.0).requires_grad_()
    params = (x, norm.weight, norm.bias)
    grads_stock = torch.autograd.grad(norm(x).float().square().sum(), params)
    with torchgraft.enabled():
        grads = torch.autograd.grad(norm(x).float().square().sum(), params)
    assert calls(FWD) == 1 and calls(BWD) == 1
    for g, s in zip(grads, grads_stock, strict=True):
        assert rel_err(g, s) < 8 * TOL[dtype]


def test_gradcheck_float64():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with torchgraft.enabled():
        assert torch.autograd.gradcheck(
            lambda *t: F.layer_norm(t[0], [4, 5], t[1], t[2]), (x, w, b)
        )
        assert torch.autograd.gradgradcheck(lambda t: F.layer_norm(t, [5]), (x,))
    assert calls(FWD) > 0 and calls(BWD) > 0


def test_torch_compile_aot_eager_runs_the_grafts():
    norm = torch.nn.LayerNorm(64)
    x = randn(8, 64).requires_grad_()
    # A random weighting: sum(norm(x) ** 2) alone is constant in x up to eps, its gradient
    # cancellation noise.
    c = randn(8, 64)

    def f(t):
        return (norm(t) * c).sum()

    (want,) = torch.autograd.grad(f(x), x)
    with torchgraft.enabled():
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        (got,) = torch.autograd.grad(compiled(x), x)
    assert calls(FWD) >= 1 and calls(BWD) >= 1
    assert rel_err(got, want) < 1e-5


def test_weight_gradient_is_deterministic_and_thread_count_free():
    x, dy = randn(512, 300, shift=1.0), randn(512, 300)
    w = randn(300)
    _, mean, rstd = A.native_layer_norm(x, [300], w, None, 1e-5)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            with torchgraft.enabled():
                outs.append(
                    A.native_layer_norm_backward(
                        dy, x, [300], mean, rstd, w, None, [True, True, False]
                    )
                )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)


def test_disable_restores_aten_and_grafts_are_listed():
    x = randn(4, 9)
    with torchgraft.enabled():
        A.native_layer_norm(x, [9], None, None, 1e-5)
        rows = {(r["op"], r["dispatch_key"]) for r in list_rows()}
    A.native_layer_norm(x, [9], None, None, 1e-5)
    assert calls(FWD) == 1
    for name in ("native_layer_norm", "native_layer_norm_backward"):
        assert (f"aten::{name}", "CPU") in rows and (f"aten::{name}", "CUDA") in rows
