"""The native softmax / log-softmax grafts on CUDA: every kernel path (rows in registers, vector
and scalar; the loop kernel staged in shared memory and not; rows split over clusters of
blocks; persistent clusters; the cols kernel for inner dims)
against float64 and ATen's CUDA kernels, half_to_float, special values, layouts, errors,
autograd and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.grafts.softmax.reference import softmax_backward_reference, softmax_reference

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 8e-3, torch.float16: 1e-3}
A = torch.ops.aten
OPS = {
    "softmax": (A._softmax, A._softmax_backward_data),
    "log_softmax": (A._log_softmax, A._log_softmax_backward_data),
}
# Widths through every path: sub-warp and multi-warp rows, the register limit (8k-16k
# elements forward, 8k-16k backward), the staged loop kernel, rows split over clusters of 2-8
# blocks, and rows too wide to stage even so (float64 at 262144).
WIDTHS = [1, 7, 64, 1000, 1024, 4096, 5000, 8192, 16384, 16385, 32768, 65536, 131072, 262144]


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    # Every call to the kernels, so that every path is tested (by default a call goes to them
    # only where they were measured faster than ATen: see the policy tests at the end).
    monkeypatch.setenv("TORCHGRAFT_CUDA_SOFTMAX", "always")
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def key(op: str, backward: bool = False) -> str:
    name = f"_{op}_backward_data" if backward else f"_{op}"
    return f"native/aten::{name}/CUDA"


def calls(k: str) -> int:
    return torchgraft.stats()[k]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def randn(*shape, dtype=torch.float32, scale=3.0, offset=0):
    """Random values on the GPU; ``offset`` > 0 starts the tensor that many elements into its
    buffer (rows not 16-byte aligned: the scalar kernels)."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + offset, device="cuda", dtype=torch.float64) * scale
    return flat[offset:].view(*shape).to(dtype)


def poison_allocator(shape, dtype):
    """Frees a NaN-filled block the size of the output, which the caching allocator hands to the
    next allocation of that size: an element a kernel does not write then shows as NaN."""
    torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def check_both(op, x, dim, dy, dtype, out_dtype=None, input_dtype=None):
    fwd, bwd = OPS[op]
    log = op == "log_softmax"
    half_to_float = out_dtype is not None
    with torchgraft.enabled():
        poison_allocator(x.shape, out_dtype or dtype)
        y = fwd(x, dim, half_to_float)
        poison_allocator(x.shape, input_dtype or dtype)
        dx = bwd(dy, y, dim, input_dtype or y.dtype)
    torch.cuda.synchronize()
    assert not y.isnan().any() and not dx.isnan().any()
    assert y.dtype == (out_dtype or dtype) and y.is_contiguous()
    assert rel_err(y, softmax_reference(x, dim, log)) < TOL[out_dtype or dtype]
    dx_ref = softmax_backward_reference(dy, y, dim, log)
    terms = dy.double().norm() * (1.0 if log else y.double().abs().max())
    err = ((dx.double() - dx_ref).norm() / max(dx_ref.norm(), terms)).item()
    assert err < 4 * TOL[input_dtype or dtype]
    return y, dx


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("op", list(OPS))
def test_last_dim_every_width(dtype, width, op):
    rows = max(1, min(64, (1 << 22) // width))
    x = randn(rows, width, dtype=dtype)
    dy = randn(rows, width, dtype=dtype, scale=1.0)
    check_both(op, x, -1, dy, dtype)
    assert calls(key(op)) == 1 and calls(key(op, True)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("width", [5, 999, 4099, 20001, 70001])
@pytest.mark.parametrize("op", list(OPS))
def test_misaligned_and_odd_widths_take_the_scalar_paths(dtype, width, op):
    x = randn(3, width, dtype=dtype, offset=1)
    dy = randn(3, width, dtype=dtype, scale=1.0, offset=3)
    check_both(op, x, 1, dy, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((4, 7, 33), 0), ((2, 1000, 64), 1), ((3, 5, 2), 1), ((8, 3, 4096), 1), ((2, 2, 3, 5), 2)],
)
@pytest.mark.parametrize("op", list(OPS))
def test_inner_dims(dtype, shape, dim, op):
    x = randn(*shape, dtype=dtype)
    dy = randn(*shape, dtype=dtype, scale=1.0)
    check_both(op, x, dim, dy, dtype)


@pytest.mark.parametrize("width", [100, 4096, 50000, 131072])
@pytest.mark.parametrize("op", list(OPS))
def test_half_to_float_like_aten(width, op):
    fwd, bwd = OPS[op]
    x = randn(8, width, dtype=torch.float16)
    dy = randn(8, width, dtype=torch.float32, scale=1.0)
    y, dx = check_both(op, x, 1, dy, torch.float16, torch.float32, torch.float16)
    assert dx.dtype == torch.float16
    y_aten = fwd(x, 1, True)
    dx_aten = bwd(dy, y_aten, 1, torch.float16)
    assert rel_err(y, y_aten) < 2e-6
    assert rel_err(dx, dx_aten) < 4e-3


@pytest.mark.parametrize("op", list(OPS))
def test_softmax_to_float_of_a_half_input_uses_half_to_float(op):
    fn = F.softmax if op == "softmax" else F.log_softmax
    x = randn(16, 512, dtype=torch.float16).requires_grad_()
    with torchgraft.enabled():
        y = fn(x, -1, dtype=torch.float32)
        (g,) = torch.autograd.grad(y.square().sum(), x)
    assert y.dtype == torch.float32 and g.dtype == torch.float16
    assert calls(key(op)) == 1 and calls(key(op, True)) == 1
    (g_aten,) = torch.autograd.grad(fn(x, -1, dtype=torch.float32).square().sum(), x)
    assert rel_err(g, g_aten) < 4e-3


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("width", [5, 600, 40000, 200000])
@pytest.mark.parametrize("dim", [1, 0])
def test_special_values_exactly_as_aten(op, width, dim):
    inf, nan = float("inf"), float("nan")
    x = torch.full((6, width), -2.0, device="cuda")
    specials = torch.tensor(
        [
            [1.0, nan, 2.0, 0.5, -1.0],
            [1.0, inf, 2.0, 0.5, -1.0],
            [-inf, -inf, -inf, -inf, -inf],
            [-inf, 0.5, -inf, 1.5, 3.0],
            [inf, inf, 0.0, 0.0, 0.0],
            [3.0, 3.0, 3.0, 3.0, 3.0],
        ],
        device="cuda",
    )
    x[:, :5] = specials
    x[2] = -inf  # a whole row of -inf
    x = x if dim == 1 else x.t().contiguous()
    fwd = OPS[op][0]
    want = fwd(x, dim, False)
    with torchgraft.enabled():
        got = fwd(x, dim, False)
    assert torch.equal(got.isnan(), want.isnan())
    exact = ~want.isnan() & (want.isinf() | (want == 0))
    assert torch.equal(got[exact], want[exact])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [65536, 262147])
def test_rows_split_over_blocks_merge_special_values_like_aten(op, dtype, width):
    # Rows this wide are split over a cluster of blocks (sm_90+), each staging a slice: a
    # slice of only -inf, and an infinity or a NaN in the last slice, must merge as ATen's.
    inf, nan = float("inf"), float("nan")
    x = randn(5, width)
    x[0, : width // 2] = -inf
    x[1, -1] = inf
    x[2, -3] = nan
    x[3, : width - 10] = -inf
    x = x.to(dtype)
    fwd = OPS[op][0]
    want = fwd(x, -1, False)
    with torchgraft.enabled():
        poison_allocator(x.shape, dtype)
        got = fwd(x, -1, False)
        assert calls(key(op)) == 1
    assert torch.equal(got.isnan(), want.isnan())
    assert got[1:3].isnan().all()
    exact = ~want.isnan() & (want.isinf() | (want == 0))
    assert torch.equal(got[exact], want[exact])
    for r in (0, 3, 4):
        ref = softmax_reference(x[r], -1, op == "log_softmax")
        finite = ref.isfinite()  # log-softmax's -inf are checked exactly above
        assert rel_err(got[r][finite], ref[finite]) < TOL[dtype]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(200, 65536), (37, 131072), (61, 65544), (40, 262144)])
def test_wide_16_bit_rows_on_persistent_clusters(op, dtype, rows, width):
    # 16-bit rows too wide for one block run on a persistent grid of clusters (the bulk
    # kernels, sm_90+; the backward up to ~232k columns): more rows than resident clusters, so
    # each cluster walks several rows through its two buffers; 65544 columns give the last
    # block of a cluster a shorter slice. Each row is checked on its own, so a row that took
    # another's partials would show.
    log = op == "log_softmax"
    fwd, bwd = OPS[op]
    x = randn(rows, width, dtype=dtype)
    dy = randn(rows, width, dtype=dtype, scale=1.0)
    y_aten = fwd(x, -1, False)
    with torchgraft.enabled():
        poison_allocator(x.shape, dtype)
        y = fwd(x, -1, False)
        poison_allocator(x.shape, dtype)
        dx = bwd(dy, y_aten, -1, dtype)
        assert calls(key(op)) == 1 and calls(key(op, True)) == 1
        # The same bits every time: no block reads a buffer or a partial before it is there.
        for _ in range(3):
            assert torch.equal(fwd(x, -1, False), y)
            assert torch.equal(bwd(dy, y_aten, -1, dtype), dx)
    torch.cuda.synchronize()
    assert not y.isnan().any() and not dx.isnan().any()
    y_ref = softmax_reference(x, -1, log)
    y_err = (y.double() - y_ref).norm(dim=1) / y_ref.norm(dim=1)
    assert y_err.max().item() < TOL[dtype], f"row {y_err.argmax().item()}"
    ref = softmax_backward_reference(dy, y_aten, -1, log)
    terms = dy.double().norm(dim=1) * (1.0 if log else y_aten.double().abs().amax(dim=1))
    err = (dx.double() - ref).norm(dim=1) / torch.maximum(ref.norm(dim=1), terms)
    assert err.max().item() < 4 * TOL[dtype], f"row {err.argmax().item()}"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    diff = (out.double() - ref.double()).norm()
    return float(diff / max(ref.double().norm().item(), 1e-30))


@pytest.mark.parametrize("op", list(OPS))
def test_layouts_and_empty_and_zero_dim(op):
    fwd, bwd = OPS[op]
    cases = [
        randn(40, 6).t(),
        randn(5, 80)[:, ::3],
        randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.tensor(1.5, device="cuda"),
        torch.empty(0, 5, device="cuda"),
        torch.empty(3, 0, device="cuda"),
    ]
    for x in cases:
        for dim in range(max(x.dim(), 1)):
            want = fwd(x, dim, False)
            want_b = bwd(want, want, dim, x.dtype)
            with torchgraft.enabled():
                got = fwd(x, dim, False)
                got_b = bwd(want, want, dim, x.dtype)
            assert got.shape == want.shape and got.stride() == want.stride()
            # Within float32 rounding of ATen's results (another order of the row sums).
            assert _rel(got, want) <= 1e-5 and _rel(got_b, want_b) <= 1e-5


def test_many_rows_loop_over_the_grid():
    # More row sets than one launch's grid covers at once.
    x = randn(300_000, 8)
    y, _ = check_both("softmax", x, 1, randn(300_000, 8, scale=1.0), torch.float32)
    assert y.shape == x.shape


def test_deterministic():
    x = randn(64, 100_000, dtype=torch.bfloat16)
    with torchgraft.enabled():
        a = A._log_softmax(x, 1, False)
        b = A._log_softmax(x, 1, False)
    assert torch.equal(a, b)


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


ERROR_CASES = {
    "bf16_half_to_float": lambda: A._softmax(randn(3, 4, dtype=torch.bfloat16), 1, True),
    "f32_half_to_float": lambda: A._log_softmax(randn(3, 4), 1, True),
    "long": lambda: A._softmax(torch.arange(4, device="cuda"), 0, False),
    "dim": lambda: A._log_softmax(randn(3, 4), 2, False),
    "bwd_types": lambda: A._softmax_backward_data(
        randn(3, 4, dtype=torch.float16), randn(3, 4, dtype=torch.float16), 1, torch.float32
    ),
    "bwd_sizes": lambda: A._softmax_backward_data(randn(3, 3), randn(3, 4), 1, torch.float32),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_like_aten(case):
    theirs = _error_of(ERROR_CASES[case])
    with torchgraft.enabled():
        ours = _error_of(ERROR_CASES[case])
    assert issubclass(ours[0], RuntimeError)
    assert ours[1] == theirs[1], (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_training_step_hits_both_kernels(dtype):
    logits = randn(512, 32000, dtype=dtype).requires_grad_()
    target = torch.randint(0, 32000, (512,), device="cuda")
    loss_aten = F.cross_entropy(logits.float(), target)
    (g_aten,) = torch.autograd.grad(loss_aten, logits)
    with torchgraft.enabled():
        loss = F.cross_entropy(logits.float(), target)
        (g,) = torch.autograd.grad(loss, logits)
    assert calls(key("log_softmax")) == 1 and calls(key("log_softmax", True)) == 1
    assert abs(loss.item() - loss_aten.item()) < 1e-5 * abs(loss_aten.item())
    assert rel_err(g, g_aten) < 4 * TOL[dtype]


def test_gradcheck_and_compile():
    x = torch.randn(3, 7, 5, dtype=torch.float64, device="cuda", requires_grad=True)
    with torchgraft.enabled():
        for dim in (0, 1, 2):
            assert torch.autograd.gradcheck(lambda t, d=dim: F.softmax(t, d), (x,))
            assert torch.autograd.gradcheck(lambda t, d=dim: F.log_softmax(t, d), (x,))

        def f(t):
            return F.log_softmax(t, -1).sum() + F.softmax(t * 2, 1).square().sum()

        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        (got,) = torch.autograd.grad(compiled(x), x)
    (want,) = torch.autograd.grad(f(x), x)
    assert rel_err(got, want) < 1e-12


# ---------------------------------------------------------------- the default policy


POLICY_CASES = {
    # (op, dtype, shape, dim): whether the kernels take the forward / the backward.
    "bf16 softmax 4096": ("softmax", torch.bfloat16, (64, 4096), -1, True, True),
    "f16 softmax 65536": ("softmax", torch.float16, (8, 65536), -1, True, True),
    "bf16 softmax 131072": ("softmax", torch.bfloat16, (4, 131072), -1, True, True),
    "f32 softmax": ("softmax", torch.float32, (64, 4096), -1, False, False),
    "bf16 softmax inner dim": ("softmax", torch.bfloat16, (64, 32, 8), 1, False, False),
    "bf16 log_softmax 1024": ("log_softmax", torch.bfloat16, (64, 1024), -1, True, True),
    "bf16 log_softmax 16384": ("log_softmax", torch.bfloat16, (16, 16384), -1, True, False),
    "bf16 log_softmax 32768": ("log_softmax", torch.bfloat16, (8, 32768), -1, True, True),
    "bf16 log_softmax 262144": ("log_softmax", torch.bfloat16, (2, 262144), -1, True, True),
    "bf16 log_softmax 524288": ("log_softmax", torch.bfloat16, (1, 524288), -1, True, False),
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_by_default_aten_computes_what_the_kernels_were_not_measured_faster_on(case, monkeypatch):
    monkeypatch.delenv("TORCHGRAFT_CUDA_SOFTMAX")
    op, dtype, shape, dim, kernel_fwd, kernel_bwd = POLICY_CASES[case]
    fwd, bwd = OPS[op]
    x = randn(*shape, dtype=dtype)
    stock_y = fwd(x, dim, False)
    stock_dx = bwd(stock_y * 0.5, stock_y, dim, dtype)
    with torchgraft.enabled():
        y = fwd(x, dim, False)
        dx = bwd(stock_y * 0.5, stock_y, dim, dtype)
        ran = {k: dict(v) for k, v in torchgraft.stats().items() if "CUDA" in k}
    for backward, by_kernel, out, stock in (
        (False, kernel_fwd, y, stock_y),
        (True, kernel_bwd, dx, stock_dx),
    ):
        counted = ran[key(op, backward)]
        assert counted["calls"] == 1
        assert counted["fallbacks"] == (0 if by_kernel else 1), (case, backward, counted)
        if by_kernel:
            assert rel_err(out, stock) < 4 * TOL[dtype]
        else:  # ATen's own kernel: exactly stock's result
            assert torch.equal(out, stock)


def test_half_to_float_goes_to_aten_by_default(monkeypatch):
    monkeypatch.delenv("TORCHGRAFT_CUDA_SOFTMAX")
    x = randn(32, 4096, dtype=torch.float16)
    stock = A._softmax(x, -1, True)
    with torchgraft.enabled():
        out = A._softmax(x, -1, True)
        assert torchgraft.stats()[key("softmax")] == {"calls": 1, "fallbacks": 1}
    assert torch.equal(out, stock)
