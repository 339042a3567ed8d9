"""Direct calls of ``aten::_fused_rms_norm`` on CPU: whatever stock PyTorch accepts, the graft
computes the same way (issue 10, items 6 and 7).

Stock CPU runs ATen's composite for this op, which reads normalized_shape only for its length and
multiplies by any weight that broadcasts; the graft replays that composite for the calls its
fused kernel does not take, and differentiates them like stock does.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torchgraft
from torchgraft import native

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split(".")[:2])

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

OP = torch.ops.aten._fused_rms_norm.default
FWD, BWD = "native/aten::_fused_rms_norm/CPU", "native/aten::_fused_rms_norm_backward/CPU"


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().to(torch.complex128), ref.detach().to(torch.complex128)
    return float((out - ref).abs().norm() / ref.abs().norm().clamp_min(1e-300))


def layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride())


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    wide = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(shape, dtype=wide).to(dtype)


# (input, normalized_shape, weight) that stock CPU accepts although they are not what F.rms_norm
# passes.
ACCEPTED = {
    "shape [7] on (4, 8)": lambda: (randn(4, 8), [7], None),
    "shape [-8] on (4, 8)": lambda: (randn(4, 8), [-8], randn(8)),
    "shape [5, 8] on (3, 4, 8)": lambda: (randn(3, 4, 8), [5, 8], None),
    "shape [] on a 0-dim input": lambda: (randn(), [], None),
    "shape [] on (4, 8): every dim": lambda: (randn(4, 8), [], None),
    "shape [3] on a 0-dim input": lambda: (randn(), [3], randn(1)),
    "int64 weight": lambda: (randn(4, 8), [8], torch.randint(-3, 4, (8,))),
    "bool weight": lambda: (randn(4, 8), [8], torch.rand(8) > 0.5),
    "float64 weight under float32": lambda: (randn(4, 8), [8], randn(8, dtype=torch.float64)),
    "broadcasting weight (1,)": lambda: (randn(4, 8), [8], randn(1)),
    "complex64 input": lambda: (randn(4, 8, dtype=torch.complex64), [8], None),
    "complex128 input and weight": lambda: (
        randn(2, 3, 8, dtype=torch.complex128),
        [8],
        randn(8, dtype=torch.complex128),
    ),
    "complex weight under float32": lambda: (randn(4, 8), [8], randn(8, dtype=torch.complex64)),
    "complex64 channels-last input": lambda: (
        randn(2, 3, 4, 5, dtype=torch.complex64).to(memory_format=torch.channels_last),
        [5],
        None,
    ),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_direct_calls_stock_accepts_compute_like_stock(case):
    torch.manual_seed(hash(case) % 1000)
    x, ns, w = ACCEPTED[case]()
    with warnings.catch_warnings(record=True) as stock_warnings:
        warnings.simplefilter("always")
        y_stock, rstd_stock = OP(x, ns, w, 1e-5)
    with torchgraft.enabled(), warnings.catch_warnings(record=True) as grafted_warnings:
        warnings.simplefilter("always")
        y, rstd = OP(x, ns, w, 1e-5)
    assert torchgraft.stats()[FWD]["calls"] == 1
    assert (layout(y), layout(rstd)) == (layout(y_stock), layout(rstd_stock))
    tol = 1e-12 if y.dtype in (torch.float64, torch.complex128) else 1e-6
    assert rel_err(y, y_stock) < tol and rel_err(rstd, rstd_stock) < tol
    # The same warnings (e.g. "Casting complex values to real discards the imaginary part").
    grafted = {str(w.message) for w in grafted_warnings}
    stock = {str(w.message) for w in stock_warnings}
    if TORCH_VERSION >= (2, 15):
        # torch 2.15's stable-ABI dispatcher call drops the warnings of the ops a native kernel
        # calls (docs/reliability.md, known differences): none may be invented, though.
        assert grafted <= stock
    else:
        assert grafted == stock


def test_fused_calls_are_not_counted_as_fallbacks_and_odd_ones_are():
    with torchgraft.enabled():
        OP(randn(4, 8), [8], randn(8), None)
        OP(randn(4, 8), [7], None, None)
    assert torchgraft.stats()[FWD] == {"calls": 2, "fallbacks": 1}


GRAD_CASES = {
    "shape [7] on (4, 8)": (lambda: randn(4, 8, dtype=torch.float64), [7], True),
    "shape [] on (3, 5): every dim": (lambda: randn(3, 5, dtype=torch.float64), [], True),
    "shape [] on a 0-dim input": (lambda: randn(dtype=torch.float64), [], False),
    "shape [-4, 6] on (2, 4, 6)": (lambda: randn(2, 4, 6, dtype=torch.float64), [-4, 6], False),
}


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_of_direct_calls_match_stock(case):
    make, ns, with_weight = GRAD_CASES[case]
    x = make().requires_grad_()
    w = randn(*x.shape[x.dim() - len(ns) :], dtype=torch.float64).requires_grad_()
    w = w if with_weight else None
    inputs = (x,) if w is None else (x, w)

    def f(*args):
        y, _ = OP(args[0], ns, args[1] if len(args) > 1 else None, 1e-3)
        return (y * torch.cos(torch.arange(y.numel(), dtype=y.dtype).view_as(y))).sum()

    stock = torch.autograd.grad(f(*inputs), inputs)
    with torchgraft.enabled():
        grafted = torch.autograd.grad(f(*inputs), inputs)
        assert torch.autograd.gradcheck(f, inputs)
    assert torchgraft.stats()[BWD]["calls"] >= 1
    for g, s in zip(grafted, stock, strict=True):
        assert rel_err(g, s) < 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_weight_gradient_under_a_half_input_is_float32_accurate(dtype):
    # F.rms_norm sends mixed dtypes to the composite; a direct call reaches the graft, whose
    # backward must not round dw to the input's dtype.
    torch.manual_seed(0)
    x = randn(64, 256, dtype=dtype).requires_grad_()
    w = randn(256).requires_grad_()
    dy = randn(64, 256, dtype=dtype)

    def weight_grad() -> torch.Tensor:
        y, _ = OP(x, [256], w, 1e-6)
        return torch.autograd.grad(y, w, dy)[0]

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    reference = torch.autograd.grad(y64, w64, dy.double())[0]
    stock = weight_grad()
    with torchgraft.enabled():
        grafted = weight_grad()
    assert torchgraft.stats()[BWD]["calls"] == 1
    assert grafted.dtype == torch.float32
    assert rel_err(grafted, reference) < max(4 * rel_err(stock, reference), 1e-6)


NOT_IMPLEMENTED = [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", NOT_IMPLEMENTED, ids=str)
def test_unsupported_dtypes_fail_with_atens_message(dtype):
    x = torch.ones(4, 8).to(dtype)
    with pytest.raises(NotImplementedError) as stock:
        OP(x, [8], None, None)
    with torchgraft.enabled(), pytest.raises(RuntimeError) as grafted:
        OP(x, [8], None, None)
    # The message is ATen's, the dtype named as c10 names it (e.g. 'Float8_e4m3fn').
    assert str(grafted.value) == str(stock.value).splitlines()[0]
    # The type: a stable-ABI kernel can only raise c10::Error, a RuntimeError in Python, of
    # which NotImplementedError is a subclass: `except RuntimeError` catches both
    # (docs/reliability.md, "Errors").
    assert isinstance(stock.value, RuntimeError)
