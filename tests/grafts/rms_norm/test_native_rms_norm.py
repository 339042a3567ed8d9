"""The native RMSNorm graft on CPU: numerics, gradients, ATen semantics, errors, control."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native
from torchgraft.grafts.rms_norm.reference import (
    rms_norm_backward_reference,
    rms_norm_reference,
)

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Relative-norm tolerances against a float64 reference: rounding of the output dtype.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 8e-3, torch.float16: 1e-3}
FWD, BWD = "native/aten::_fused_rms_norm/CPU", "native/aten::_fused_rms_norm_backward/CPU"
# torch >= 2.13 hands the message of an op a stable-ABI kernel called back to it.
NESTED_MESSAGES = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def default_eps(dtype: torch.dtype) -> float:
    """eps=None as ATen reads it: machine epsilon of the accumulation type."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def calls(key: str) -> int:
    return torchgraft.stats()[key]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def poison_check(t: torch.Tensor) -> None:
    assert not torch.isnan(t).any(), "an output element was not written"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("shape", "normalized"),
    [((8, 64), 1), ((2, 3, 100), 1), ((4, 7, 33), 2), ((5,), 1), ((3, 4097), 1), ((2, 2, 3, 5), 3)],
)
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_matches_float64_reference(dtype, shape, normalized, with_weight):
    x = randn(*shape, dtype=dtype)
    ns = list(shape[-normalized:])
    w = randn(*ns, dtype=dtype) if with_weight else None
    with torchgraft.enabled():
        y, rstd = torch.ops.aten._fused_rms_norm(x, ns, w, 1e-5)
    assert calls(FWD) == 1
    y_ref, rstd_ref = rms_norm_reference(x.double(), ns, None if w is None else w.double(), 1e-5)
    poison_check(y)
    assert y.dtype == dtype and rstd.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    assert rel_err(y, y_ref) < TOL[dtype]
    # rstd sums `cols` squares in float32: a few ulps of accumulated rounding.
    assert rel_err(rstd, rstd_ref) < (1e-12 if dtype == torch.float64 else 4e-6)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_backward_matches_float64_reference(dtype, mask, with_weight):
    shape, ns = (6, 5, 96), [96]
    x, dy = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    w = randn(*ns, dtype=dtype) if with_weight else None
    _, rstd = rms_norm_reference(x.double(), ns, None if w is None else w.double(), 1e-6)
    rstd = rstd.to(torch.float64 if dtype == torch.float64 else torch.float32)
    with torchgraft.enabled():
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, ns, rstd, w, list(mask))
    assert calls(BWD) == 1
    dx_ref, dw_ref = rms_norm_backward_reference(
        dy.double(), x.double(), ns, rstd.double(), None if w is None else w.double(), list(mask)
    )
    if mask[0]:
        assert dx.dtype == dtype and dx.shape == x.shape
        assert rel_err(dx, dx_ref) < 4 * TOL[dtype]
    else:
        assert dx is None
    if mask[1] and with_weight:
        assert dw.dtype == dtype and dw.shape == w.shape
        assert rel_err(dw, dw_ref) < 4 * TOL[dtype]
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_forward_and_backward_hit_the_kernels(dtype):
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(256, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(256, dtype=dtype))
    x = randn(4, 16, 256, dtype=dtype).requires_grad_()
    y_stock = norm(x)
    (gx_stock, gw_stock) = torch.autograd.grad(y_stock.float().square().sum(), (x, norm.weight))
    with torchgraft.enabled():
        y = norm(x)
        (gx, gw) = torch.autograd.grad(y.float().square().sum(), (x, norm.weight))
    assert calls(FWD) == 1 and calls(BWD) == 1
    assert rel_err(y, y_stock) < 2 * TOL[dtype]
    assert rel_err(gx, gx_stock) < 4 * TOL[dtype]
    assert rel_err(gw, gw_stock) < 4 * TOL[dtype]


def test_gradcheck_float64():
    x = randn(3, 4, 7, dtype=torch.float64).requires_grad_()
    w = randn(4, 7, dtype=torch.float64).requires_grad_()
    with torchgraft.enabled():
        assert torch.autograd.gradcheck(lambda x, w: F.rms_norm(x, [4, 7], w, 1e-3), (x, w))
        assert torch.autograd.gradcheck(lambda x: F.rms_norm(x, [7], None, None), (x,))
        assert torch.autograd.gradgradcheck(lambda x, w: F.rms_norm(x, [7], w[0], 1e-3), (x, w))
    assert calls(FWD) > 0 and calls(BWD) > 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_eps_none_is_machine_epsilon_of_the_accumulation_type(dtype):
    # Rows of tiny values make eps dominate the mean of squares, so the value of eps shows.
    x = (randn(4, 16) * 1e-4).to(dtype)
    with torchgraft.enabled():
        _, rstd = torch.ops.aten._fused_rms_norm(x, [16], None, None)
    _, rstd_ref = rms_norm_reference(x.double(), [16], None, default_eps(dtype))
    assert rel_err(rstd, rstd_ref) < 1e-6


def meta_outputs(op, *args):
    def to_meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a

    return op(*[to_meta(a) for a in args])


def layout(t):
    return None if t is None else (t.dtype, tuple(t.shape), t.stride())


LAYOUT_CASES = {
    "contiguous": lambda: randn(2, 3, 8),
    "transposed": lambda: randn(8, 6).t(),
    "sliced": lambda: randn(4, 16)[:, ::2],
    "expanded": lambda: randn(1, 8).expand(5, 8),
    "channels_last": lambda: randn(2, 3, 4, 8).to(memory_format=torch.channels_last),
    "channels_last_3d": lambda: randn(2, 3, 2, 4, 8).to(memory_format=torch.channels_last_3d),
    "storage_offset": lambda: randn(40)[3:35].view(4, 8),
    "empty_rows": lambda: randn(0, 8),
    "empty_batch": lambda: randn(2, 0, 8),
    "one_element": lambda: randn(1),
}


@pytest.mark.parametrize("case", LAYOUT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_have_the_layout_of_atens_meta_function(case, dtype):
    x = LAYOUT_CASES[case]().to(dtype)
    ns = [x.shape[-1]]
    w = randn(*ns, dtype=dtype)
    fwd, bwd = (
        torch.ops.aten._fused_rms_norm.default,
        torch.ops.aten._fused_rms_norm_backward.default,
    )
    with torchgraft.enabled():
        y, rstd = fwd(x, ns, w, None)
        dy = torch.randn_like(y)
        dx, dw = bwd(dy, x, ns, rstd, w, [True, True])
    y_meta, rstd_meta = meta_outputs(fwd, x, ns, w, None)
    dx_meta, dw_meta = meta_outputs(bwd, dy, x, ns, rstd, w, [True, True])
    assert calls(FWD) == 1 and calls(BWD) == 1
    assert layout(y) == layout(y_meta) and layout(rstd) == layout(rstd_meta)
    assert layout(dx) == layout(dx_meta) and layout(dw) == layout(dw_meta)
    if x.numel():
        y_ref, _ = rms_norm_reference(x.double(), ns, w.double(), default_eps(dtype))
        assert rel_err(y, y_ref) < TOL[dtype]


def test_empty_normalized_dims_give_nan_rstd_like_the_composite():
    x = randn(3, 0)
    with torchgraft.enabled():
        y, rstd = torch.ops.aten._fused_rms_norm(x, [0], None, None)
    y_stock, rstd_stock = torch.ops.aten._fused_rms_norm(x, [0], None, None)
    assert y.shape == y_stock.shape and rstd.shape == rstd_stock.shape == (3, 1)
    assert torch.isnan(rstd).all() and torch.isnan(rstd_stock).all()


def test_empty_batch_backward_gives_zero_weight_grad():
    x, w = randn(0, 8), randn(8)
    with torchgraft.enabled():
        dx, dw = torch.ops.aten._fused_rms_norm_backward(x, x, [8], randn(0, 1), w, [True, True])
    assert dx.shape == (0, 8) and dw.shape == (8,)
    assert torch.equal(dw, torch.zeros(8))


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_inf_propagate_like_the_reference(dtype):
    x = randn(4, 32, dtype=dtype)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    w = randn(32, dtype=dtype)
    y_stock, rstd_stock = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
    with torchgraft.enabled():
        y, rstd = torch.ops.aten._fused_rms_norm(x, [32], w, 1e-5)
    assert torch.equal(torch.isnan(y), torch.isnan(y_stock))
    assert torch.equal(torch.isnan(rstd), torch.isnan(rstd_stock))
    assert torch.equal(torch.isinf(y), torch.isinf(y_stock))
    finite = torch.isfinite(y_stock)
    assert rel_err(y[finite], y_stock[finite]) < 2 * TOL[dtype]


def test_mixed_weight_dtype_on_direct_calls_matches_the_composite():
    # F.rms_norm routes mixed dtypes to the composite; direct calls of the op reach the graft.
    x, w = randn(4, 24, dtype=torch.bfloat16), randn(24, dtype=torch.float32)
    y_stock, rstd_stock = torch.ops.aten._fused_rms_norm(x, [24], w, 1e-5)
    with torchgraft.enabled():
        y, rstd = torch.ops.aten._fused_rms_norm(x, [24], w, 1e-5)
    assert layout(y) == layout(y_stock) and layout(rstd) == layout(rstd_stock)
    assert rel_err(y, y_stock) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: F.rms_norm(randn(3, 4), [5]), "expected input with shape [*5]"),
        (lambda: F.rms_norm(randn(3, 4), [4], randn(5)), "Expected weight to be of same shape"),
        (
            # A direct call runs ATen's composite, as on stock CPU: the weight must broadcast.
            lambda: torch.ops.aten._fused_rms_norm(randn(3, 4), [4], randn(2, 2), None),
            "The size of tensor a (4) must match the size of tensor b (2)",
        ),
        (
            lambda: torch.ops.aten._fused_rms_norm(torch.randint(0, 9, (3, 4)), [4], None, None),
            "\"rms_norm\" not implemented for 'Long'",
        ),
        (
            lambda: torch.ops.aten._fused_rms_norm_backward(
                randn(3, 5), randn(3, 4), [4], randn(3, 1), None, [True, True]
            ),
            "grad_out of size [3, 5] does not match input",
        ),
        (
            lambda: torch.ops.aten._fused_rms_norm_backward(
                randn(3, 4), randn(3, 4), [4], randn(2, 1), None, [True, True]
            ),
            "rstd has 2 elements",
        ),
        (
            lambda: torch.ops.aten._fused_rms_norm_backward(
                randn(3, 4), randn(3, 4), [4], randn(3, 1), randn(5), [True, True]
            ),
            "The expanded size of the tensor (4) must match the existing size (5)",
        ),
    ],
)
def test_invalid_calls_raise_runtime_error(call, message):
    with torchgraft.enabled(), pytest.raises(RuntimeError) as info:
        call()
    if message.startswith(("The size of tensor", "The expanded size")) and not NESTED_MESSAGES:
        # Raised by an op the graft calls; torch < 2.13 only logs its message to stderr.
        message = "failed (torch logged the reason above)"
    assert message in str(info.value)
    # The same call on stock PyTorch fails too (stock CPU has no backward kernel at all); direct
    # forward calls that stock's composite accepts are in test_reliability_direct_calls.py.


def test_enable_disable_restore_stock_behaviour_exactly():
    x, w = randn(4, 8, 64), randn(64)
    stock = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    torchgraft.enable()
    torchgraft.enable()  # idempotent
    assert torchgraft.is_enabled()
    grafted = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    assert calls(FWD) == 1
    torchgraft.disable()
    torchgraft.disable()  # idempotent
    assert not torchgraft.is_enabled()
    after = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    assert calls(FWD) == 1, "the graft ran after disable()"
    assert all(torch.equal(a, b) for a, b in zip(stock, after, strict=True))
    assert rel_err(grafted[0], stock[0]) < 1e-6
    with torchgraft.enabled():
        with torchgraft.enabled():
            torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
        assert torchgraft.is_enabled(), "an inner enabled() must not disable the outer one"
        torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    assert not torchgraft.is_enabled()
    assert calls(FWD) == 3


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("TORCHGRAFT_DISABLE", "1")
    torchgraft.enable()
    assert not torchgraft.is_enabled()
    torch.ops.aten._fused_rms_norm(randn(2, 8), [8], None, None)
    assert calls(FWD) == 0


def test_set_num_threads_does_not_change_results():
    x, dy, w = randn(64, 4096), randn(64, 4096), randn(4096)
    threads = torch.get_num_threads()
    results = []
    try:
        with torchgraft.enabled():
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                y, rstd = torch.ops.aten._fused_rms_norm(x, [4096], w, None)
                dx, dw = torch.ops.aten._fused_rms_norm_backward(
                    dy, x, [4096], rstd, w, [True, True]
                )
                results.append((y, dx, dw))
    finally:
        torch.set_num_threads(threads)
    for y, dx, dw in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])
        assert torch.equal(dw, results[0][2]), "dw must be bit-identical for any thread count"


def test_calls_from_many_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor

    inputs = [(randn(16, 128).requires_grad_(), randn(128).requires_grad_()) for _ in range(16)]

    def run(pair):
        x, w = pair
        y = F.rms_norm(x, [128], w, 1e-6)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
        return y.detach(), gx, gw

    expected = [run(p) for p in inputs]
    with torchgraft.enabled(), ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            got = list(pool.map(run, inputs))
            for (y, gx, gw), (ye, gxe, gwe) in zip(got, expected, strict=True):
                assert rel_err(y, ye) < 1e-6 and rel_err(gx, gxe) < 1e-5 and rel_err(gw, gwe) < 1e-5
    assert calls(FWD) == 80 and calls(BWD) == 80


def test_no_memory_growth_over_many_calls_and_reenables():
    import ctypes
    import gc

    libc = ctypes.CDLL("libc.so.6")

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()
        ]

    libc.mallinfo2.restype = MallInfo2

    def heap_in_use():
        gc.collect()
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    x, w = randn(8, 64).requires_grad_(), randn(64).requires_grad_()

    def rounds(n):
        for _ in range(n):
            # The native route only: re-installing a Python-route router retains ~60 bytes a
            # time inside torch.library itself (docs/registry.md).
            torchgraft.enable(routes=["native"])
            for _ in range(50):
                # eps given: the optional heap cell is exercised; weight: an optional tensor.
                F.rms_norm(x, [64], w, 1e-5).sum().backward()
            torchgraft.disable()

    rounds(20)
    heap0, rss0 = heap_in_use(), rss()
    rounds(100)  # 10^4 grafted calls: 5000 forward + 5000 backward
    heap1, rss1 = heap_in_use(), rss()
    assert calls(FWD) == 6000 and calls(BWD) == 6000
    assert heap1 - heap0 < 10_000, f"malloc'd bytes grew by {heap1 - heap0} over 10^4 calls"
    assert rss1 - rss0 < 1 << 20, f"resident memory grew by {rss1 - rss0} bytes"


def test_import_changes_nothing_and_imports_no_dsl():
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "before = torch._C._dispatch_dump('aten::_fused_rms_norm')\n"
        "import torchgraft\n"
        "assert torch._C._dispatch_dump('aten::_fused_rms_norm') == before\n"
        "dsls = ['triton', 'cutlass', 'helion', 'cuda.tile']\n"
        "print([m for m in dsls if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_large_rows_and_odd_widths():
    for cols in (1, 3, 17, 1000, 4097):
        x = randn(math.ceil(5000 / cols) + 3, cols, dtype=torch.bfloat16)
        with torchgraft.enabled():
            y, _ = torch.ops.aten._fused_rms_norm(x, [cols], None, None)
        y_ref, _ = rms_norm_reference(x.double(), [cols], None, default_eps(x.dtype))
        assert rel_err(y, y_ref) < TOL[torch.bfloat16]
