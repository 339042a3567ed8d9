"""The pure-PyTorch RMSNorm reference against PyTorch's own ops and autograd (CPU)."""

import pytest
import torch
from torch._decomp import decomposition_table

from torchgraft.grafts.rms_norm import (
    default_eps,
    rms_norm_backward_reference,
    rms_norm_eager_same_dtype,
    rms_norm_eager_upcast,
    rms_norm_reference,
)

pytestmark = pytest.mark.default_torch

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (input shape, normalized_shape)
SHAPES = [((5, 64), [64]), ((2, 3, 100), [100]), ((2, 3, 4, 5), [4, 5]), ((7,), [7])]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_default_eps_follows_the_computation_dtype():
    assert default_eps(torch.bfloat16) == torch.finfo(torch.float32).eps
    assert default_eps(torch.float16) == torch.finfo(torch.float32).eps
    assert default_eps(torch.float32) == torch.finfo(torch.float32).eps
    assert default_eps(torch.float64) == torch.finfo(torch.float64).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_forward_in_torch_dtypes_matches_aten(dtype, shape, normalized_shape, with_weight, eps):
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(normalized_shape, dtype=dtype) if with_weight else None
    y, rstd = rms_norm_reference(x, normalized_shape, w, eps, compute_dtype=None)
    y_aten, rstd_aten = aten._fused_rms_norm(x, normalized_shape, w, eps)
    for ours, theirs in ((y, y_aten), (rstd, rstd_aten)):
        assert ours.shape == theirs.shape
        assert ours.dtype == theirs.dtype
        assert ours.stride() == theirs.stride()
    # Same formula and dtypes: equal up to a rounding of the result.
    tol = {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 1e-2)
    assert rel_err(y, y_aten) < tol
    assert rel_err(rstd, rstd_aten) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True), (False, False)])
def test_backward_in_torch_dtypes_matches_the_decomposition(
    dtype, shape, normalized_shape, with_weight, mask
):
    x = torch.randn(shape, dtype=dtype)
    dy = torch.randn(shape, dtype=dtype)
    w = torch.randn(normalized_shape, dtype=dtype) if with_weight else None
    _, rstd = aten._fused_rms_norm(x, normalized_shape, w, None)
    ours = rms_norm_backward_reference(dy, x, normalized_shape, rstd, w, mask, compute_dtype=None)
    decomp = decomposition_table[aten._fused_rms_norm_backward.default]
    theirs = decomp(dy, x, normalized_shape, rstd, w, list(mask))
    meta = aten._fused_rms_norm_backward(
        dy.to("meta"),
        x.to("meta"),
        normalized_shape,
        rstd.to("meta"),
        w.to("meta") if w is not None else None,
        list(mask),
    )
    tol = {torch.float64: 1e-13, torch.float32: 1e-6}.get(dtype, 1e-2)
    for a, b, m in zip(ours, theirs, meta, strict=True):
        assert (a is None) == (b is None) == (m is None)
        if a is not None:
            assert a.shape == b.shape == m.shape
            assert a.dtype == b.dtype == m.dtype
            assert a.stride() == m.stride()
            assert rel_err(a, b) < tol


@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_float64_backward_is_the_gradient_of_the_forward(shape, normalized_shape, with_weight):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(normalized_shape, dtype=torch.float64, requires_grad=with_weight)
    w_arg = w if with_weight else None
    y, rstd = rms_norm_reference(x, normalized_shape, w_arg, 1e-6)
    dy = torch.randn(shape, dtype=torch.float64)
    grads = torch.autograd.grad(y, [x, w] if with_weight else [x], dy)
    dx, dw = rms_norm_backward_reference(dy, x.detach(), normalized_shape, rstd.detach(), w_arg)
    assert rel_err(dx, grads[0]) < 1e-12
    if with_weight:
        assert rel_err(dw, grads[1]) < 1e-12
    else:
        assert dw is None
    assert torch.autograd.gradcheck(
        lambda a: rms_norm_reference(a, normalized_shape, w_arg, 1e-6)[0], (x,)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_input_is_upcast_before_computing(dtype):
    # The float64 reference of a bf16/f32 input equals the float64 computation on the same
    # (already rounded) values, and returns float64.
    x = torch.randn(4, 33, dtype=dtype)
    w = torch.randn(33, dtype=dtype)
    y, rstd = rms_norm_reference(x, [33], w, 1e-6)
    y64, rstd64 = rms_norm_reference(x.double(), [33], w.double(), 1e-6)
    assert y.dtype == rstd.dtype == torch.float64
    assert torch.equal(y, y64)
    assert torch.equal(rstd, rstd64)


def test_shape_mismatch_raises_like_aten():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        rms_norm_reference(x, [5])
    with pytest.raises(RuntimeError, match="normalized_shape"):
        rms_norm_reference(x, [])
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm_reference(x, [4], torch.randn(5))
    with pytest.raises(RuntimeError, match="normalized_shape"):
        rms_norm_backward_reference(x, x, [2, 3, 4], torch.ones(1), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eager_baselines(dtype):
    x = torch.randn(6, 128, dtype=dtype)
    w = torch.randn(128, dtype=dtype)
    ref, _ = rms_norm_reference(x, [128], w, 1e-6)
    # Llama-style rounds twice (after normalizing, after scaling); pure low precision rounds
    # at every op.
    upcast_tol = {torch.float32: 1e-6}.get(dtype, 2e-2)
    same_dtype_tol = {torch.float32: 1e-6}.get(dtype, 5e-2)
    assert rel_err(rms_norm_eager_upcast(x, w, 1e-6), ref) < upcast_tol
    assert rel_err(rms_norm_eager_same_dtype(x, w, 1e-6), ref) < same_dtype_tol
    assert rms_norm_eager_upcast(x, w).dtype == dtype
    assert rms_norm_eager_same_dtype(x, None).dtype == dtype
