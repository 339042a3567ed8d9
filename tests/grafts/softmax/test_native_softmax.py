"""The native softmax / log-softmax grafts on CPU: numerics against float64 and ATen, special
values, every dim and layout, empty and 0-dim tensors, ATen's errors, autograd, torch.compile,
counters and control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.cli import list_rows
from torchgraft.grafts.softmax.reference import softmax_backward_reference, softmax_reference

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Relative-norm tolerances against float64: the output dtype's rounding (sums of up to ~4k
# float32 terms add a few ulps).
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPS = {
    "softmax": (torch.ops.aten._softmax, torch.ops.aten._softmax_backward_data),
    "log_softmax": (torch.ops.aten._log_softmax, torch.ops.aten._log_softmax_backward_data),
}
# (shape, dim): rows of many widths, and every position of the reduced dim.
CASES = [
    ((8, 64), -1),
    ((3, 4097), 1),
    ((2, 3, 100), 1),
    ((4, 7, 33), 0),
    ((5,), 0),
    ((2, 2, 3, 5), 2),
    ((3, 257, 70), 1),
    ((1, 1), 0),
]


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def key(op: str, backward: bool = False) -> str:
    name = f"_{op}_backward_data" if backward else f"_{op}"
    return f"native/aten::{name}/CPU"


def calls(k: str) -> int:
    return torchgraft.stats()[k]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Frees a NaN-filled tensor of the output's size, so that the output's allocation is likely
    to reuse that memory: an element the kernel does not write then shows as NaN."""
    torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("shape", "dim"), CASES)
@pytest.mark.parametrize("op", list(OPS))
def test_forward_and_backward_match_float64(dtype, shape, dim, op):
    fwd, bwd = OPS[op]
    log = op == "log_softmax"
    x = randn(*shape, dtype=dtype)
    dy = randn(*shape, dtype=dtype, scale=1.0)
    with torchgraft.enabled():
        poison_allocator(shape, dtype)
        y = fwd(x, dim, False)
        poison_allocator(shape, dtype)
        dx = bwd(dy, y, dim, dtype)
    assert calls(key(op)) == 1 and calls(key(op, True)) == 1
    for t in (y, dx):
        assert t.dtype == dtype and t.shape == x.shape and t.is_contiguous()
        assert not t.isnan().any()
    assert rel_err(y, softmax_reference(x, dim, log)) < TOL[dtype]
    # dx is a difference of terms as large as dy (times y for softmax): its rounding errors
    # are measured against those terms.
    dx_ref = softmax_backward_reference(dy, y, dim, log)
    terms = dy.double().norm() * (1.0 if log else y.double().abs().max())
    err = ((dx.double() - dx_ref).norm() / max(dx_ref.norm(), terms)).item()
    assert err < 4 * TOL[dtype]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", FLOATS)
def test_close_to_atens_cpu_kernel(op, dtype):
    fwd, bwd = OPS[op]
    x = randn(16, 1000, dtype=dtype)
    dy = randn(16, 1000, dtype=dtype, scale=1.0)
    y_aten = fwd(x, 1, False)
    dx_aten = bwd(dy, y_aten, 1, dtype)
    with torchgraft.enabled():
        y = fwd(x, 1, False)
        dx = bwd(dy, y_aten, 1, dtype)
    ref = softmax_reference(x, 1, op == "log_softmax")
    # As accurate as ATen, within rounding.
    assert rel_err(y, ref) <= max(2 * rel_err(y_aten, ref), TOL[dtype])
    assert rel_err(dx, dx_aten) < 4 * TOL[dtype]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dim", [1, 0])
def test_special_values_exactly_as_aten(op, dim):
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor(
        [
            [1.0, nan, 2.0, 0.5, -1.0],
            [1.0, inf, 2.0, 0.5, -1.0],
            [-inf, -inf, -inf, -inf, -inf],
            [-inf, 0.5, -inf, 1.5, 3.0],
            [inf, inf, 0.0, 0.0, 0.0],
            [3.0, 3.0, 3.0, 3.0, 3.0],
        ]
    )
    # Long rows too (blocks and vector lanes beyond the special values).
    wide = torch.full((6, 600), -2.0)
    wide[:, 100:105] = rows
    fwd = OPS[op][0]
    for x in (rows, wide):
        x = x if dim == 1 else x.t().contiguous()
        want = fwd(x, dim, False)
        with torchgraft.enabled():
            got = fwd(x, dim, False)
        assert torch.equal(got.isnan(), want.isnan())
        exact = ~want.isnan() & (want.isinf() | (want == 0) | (want == 1))
        assert torch.equal(got[exact], want[exact])
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert calls(key(op)) == 2


@pytest.mark.parametrize("op", list(OPS))
def test_width_one_and_zero_dim_are_exact(op):
    fwd, bwd = OPS[op]
    x = torch.tensor([[3.5], [-1e30], [0.0], [88.0]])
    s = torch.tensor(2.5)
    with torchgraft.enabled():
        y = fwd(x, 1, False)
        y0 = fwd(s, 0, False)
        y0_last = fwd(s, -1, False)
        g0 = bwd(torch.tensor(0.7), y0, 0, torch.float32)
    assert torch.equal(y, fwd(x, 1, False))
    assert torch.equal(y0, fwd(s, 0, False)) and y0.shape == ()
    assert torch.equal(y0_last, y0)
    assert torch.equal(g0, bwd(torch.tensor(0.7), fwd(s, 0, False), 0, torch.float32))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize(
    ("shape", "dim", "dtype"),
    [((0, 5), 1, torch.float32), ((3, 0), 1, torch.float32), ((0,), 0, torch.int64)],
)
def test_empty_tensors_like_aten(op, shape, dim, dtype):
    fwd, bwd = OPS[op]
    x = torch.empty(shape, dtype=dtype)
    want = fwd(x, dim, False)
    want_b = bwd(x, x, dim, torch.float16 if dtype == torch.float32 else dtype)
    with torchgraft.enabled():
        got = fwd(x, dim, False)
        got_b = bwd(x, x, dim, torch.float16 if dtype == torch.float32 else dtype)
    for g, w in ((got, want), (got_b, want_b)):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize(
    "make",
    [
        lambda: randn(6, 40).t(),
        lambda: randn(5, 80)[:, ::3],
        lambda: randn(1, 33).expand(4, 33),
        lambda: randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: randn(4, 6, 8).permute(2, 0, 1),
    ],
    ids=["transposed", "strided", "expanded", "channels_last", "permuted"],
)
def test_layouts_give_contiguous_outputs_like_aten(op, make):
    fwd, bwd = OPS[op]
    x = make()
    dy = torch.randn_like(x)
    for dim in range(x.dim()):
        want = fwd(x, dim, False)
        want_b = bwd(dy, want, dim, torch.float32)
        with torchgraft.enabled():
            got = fwd(x, dim, False)
            got_b = bwd(dy, want, dim, torch.float32)
        assert got.stride() == want.stride() and got_b.stride() == want_b.stride()
        assert rel_err(got, softmax_reference(x, dim, op == "log_softmax")) < TOL[torch.float32]
        assert torch.allclose(got_b, want_b, rtol=1e-5, atol=1e-6)


def _error_of(fn) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


A = torch.ops.aten
ERROR_CASES = {
    "half_to_float": lambda: A._softmax(randn(3, 4), 1, True),
    "half_to_float_log": lambda: A._log_softmax(randn(3, 4).half(), 1, True),
    "long_lastdim": lambda: A._softmax(torch.arange(4), 0, False),
    "long_dim0": lambda: A._log_softmax(torch.arange(12).view(3, 4), 0, False),
    "bool": lambda: A._softmax(torch.ones(4, dtype=torch.bool), 0, False),
    "complex": lambda: A._log_softmax(torch.randn(4, dtype=torch.complex64), 0, False),
    "dim_out_of_range": lambda: A._softmax(randn(3, 4), 2, False),
    "dim_negative": lambda: A._log_softmax(randn(3, 4), -3, False),
    "zero_dim_dim": lambda: A._softmax(torch.tensor(1.0), 1, False),
    "bwd_sizes": lambda: A._softmax_backward_data(randn(3, 3), randn(3, 4), 1, torch.float32),
    "bwd_dim": lambda: A._softmax_backward_data(randn(2, 3), randn(2, 3), 5, torch.float32),
    "bwd_half_input": lambda: A._softmax_backward_data(randn(3, 4), randn(3, 4), 1, torch.half),
    "bwd_output_dtype": lambda: A._log_softmax_backward_data(
        randn(3, 4), randn(3, 4).double(), 1, torch.float32
    ),
    "bwd_grad_dtype": lambda: A._softmax_backward_data(
        randn(3, 4).double(), randn(3, 4), 1, torch.float64
    ),
    "bwd_long": lambda: A._softmax_backward_data(
        torch.arange(12).view(3, 4), torch.arange(12).view(3, 4), 0, torch.int64
    ),
    "lbwd_long": lambda: A._log_softmax_backward_data(
        torch.arange(4), torch.arange(4), 0, torch.int64
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_like_aten(case):
    theirs = _error_of(ERROR_CASES[case])
    with torchgraft.enabled():
        ours = _error_of(ERROR_CASES[case])
    # The stable ABI raises RuntimeError; ATen's IndexError / NotImplementedError are
    # RuntimeError's siblings or subclasses (docs/softmax.md).
    assert issubclass(ours[0], RuntimeError)
    assert ours[1] == theirs[1], (ours, theirs)


def test_log_softmax_backward_of_mismatched_sizes_is_an_error():
    # ATen would read `output` with grad's geometry; the graft refuses.
    with torchgraft.enabled(), pytest.raises(RuntimeError, match="does not equal"):
        A._log_softmax_backward_data(randn(3, 3), randn(3, 4), 1, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_and_autograd_hit_both_kernels(dtype):
    x = randn(4, 10, 300, dtype=dtype).requires_grad_()
    target = torch.randint(0, 300, (40,))

    def loss(x):
        logits = x.view(40, 300)
        return F.cross_entropy(logits, target) + F.softmax(x, dim=1).square().sum()

    (g_stock,) = torch.autograd.grad(loss(x), x)
    with torchgraft.enabled():
        (g,) = torch.autograd.grad(loss(x), x)
    for op in OPS:
        assert calls(key(op)) == 1 and calls(key(op, True)) == 1
    assert rel_err(g, g_stock) < 4 * TOL[dtype]


@pytest.mark.parametrize("op", list(OPS))
def test_gradcheck_float64(op):
    fn = F.softmax if op == "softmax" else F.log_softmax
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    with torchgraft.enabled():
        for dim in (0, 1, 2):
            assert torch.autograd.gradcheck(lambda t, d=dim: fn(t, d), (x,))
            assert torch.autograd.gradgradcheck(lambda t, d=dim: fn(t, d), (x,))
    assert calls(key(op)) > 0 and calls(key(op, True)) > 0


def test_torch_compile_aot_eager_runs_the_grafts():
    def f(x):
        return F.log_softmax(x, -1).sum() + F.softmax(x * 2, 1).square().sum()

    x = randn(6, 5, 40).requires_grad_()
    (want,) = torch.autograd.grad(f(x), x)
    with torchgraft.enabled():
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        (got,) = torch.autograd.grad(compiled(x), x)
    for op in OPS:
        assert calls(key(op)) >= 1 and calls(key(op, True)) >= 1
    assert rel_err(got, want) < 1e-5


def test_softmax_to_float32_of_a_half_input_on_cpu_converts_first():
    # On CPU, F.softmax(dtype=float32) converts before _softmax (half_to_float is CUDA's).
    x = randn(8, 100, dtype=torch.bfloat16)
    with torchgraft.enabled():
        y = F.softmax(x, -1, dtype=torch.float32)
    assert y.dtype == torch.float32 and calls(key("softmax")) == 1
    assert rel_err(y, softmax_reference(x, -1)) < TOL[torch.float32]


def test_results_do_not_depend_on_the_thread_count():
    x = randn(64, 3000)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, threads):
            torch.set_num_threads(n)
            with torchgraft.enabled():
                outs.append(A._softmax(x, 1, False))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_disable_restores_aten_and_grafts_are_listed():
    x = randn(4, 9)
    with torchgraft.enabled():
        A._softmax(x, 1, False)
        rows = {(r["op"], r["dispatch_key"]) for r in list_rows()}
    A._softmax(x, 1, False)
    assert calls(key("softmax")) == 1
    for name in (
        "_softmax",
        "_log_softmax",
        "_softmax_backward_data",
        "_log_softmax_backward_data",
    ):
        assert (f"aten::{name}", "CPU") in rows
        assert (f"aten::{name}", "CUDA") in rows
