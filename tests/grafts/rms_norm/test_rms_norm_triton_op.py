"""The Triton RMSNorm as torch.library.triton_op custom ops: values, autograd (gradcheck in
float64), and torch.compile tracing without graph breaks. CPU tensors under TRITON_INTERPRET=1
(turned on by tests/conftest.py when there is no GPU); see test_rms_norm_triton.py's docstring.
"""

import pytest
import torch

from torchgraft.grafts import rms_norm as rms_norm_pkg
from torchgraft.grafts.rms_norm import rms_norm_backward_reference, rms_norm_reference

custom_op = pytest.importorskip("torchgraft.grafts.rms_norm.triton_op")
triton_kernels = pytest.importorskip("torchgraft.grafts.rms_norm.triton_kernels")

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(
        type(triton_kernels._rms_norm_fwd_kernel).__name__ != "InterpretedFunction",
        reason="Triton kernels are compiled for the GPU in this process",
    ),
]

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_package_exposes_the_custom_op_function():
    assert rms_norm_pkg.rms_norm is custom_op.rms_norm
    assert torch.ops.torchgraft.rms_norm_triton_fwd.default is not None
    assert torch.ops.torchgraft.rms_norm_triton_bwd.default is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_values_and_gradients_match_reference(dtype, with_weight):
    shape, normalized = (3, 5, 48), [48]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = torch.randn(normalized, dtype=dtype, requires_grad=True) if with_weight else None
    y = custom_op.rms_norm(x, normalized, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    y_ref, rstd_ref = rms_norm_reference(x.detach(), normalized, w, 1e-6)
    assert rel_err(y, y_ref) < TOL[dtype]
    dy = torch.randn(shape, dtype=dtype)
    grads = torch.autograd.grad(y, [x, w] if with_weight else [x], dy)
    dx_ref, dw_ref = rms_norm_backward_reference(
        dy, x.detach(), normalized, rstd_ref, w.detach() if with_weight else None
    )
    assert grads[0].dtype == dtype and rel_err(grads[0], dx_ref) < TOL[dtype]
    if with_weight:
        assert grads[1].dtype == dtype and rel_err(grads[1], dw_ref) < TOL[dtype]


def test_gradient_only_for_inputs_that_require_it():
    x = torch.randn(4, 32, requires_grad=False)
    w = torch.randn(32, requires_grad=True)
    (dw,) = torch.autograd.grad(custom_op.rms_norm(x, [32], w).sum(), [w])
    _, rstd = rms_norm_reference(x, [32], w.detach(), None)
    _, dw_ref = rms_norm_backward_reference(
        torch.ones_like(x), x, [32], rstd, w.detach(), (False, True)
    )
    assert rel_err(dw, dw_ref) < 1e-6
    x.requires_grad_(True)
    (dx,) = torch.autograd.grad(custom_op.rms_norm(x, [32], w.detach()).sum(), [x])
    assert dx.shape == x.shape


@pytest.mark.parametrize("with_weight", [True, False])
def test_gradcheck_float64(with_weight):
    # Inputs of unit size: with eps at float64's epsilon the finite differences stay clean.
    x = torch.randn(2, 3, 37, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, dtype=torch.float64, requires_grad=True)
    if with_weight:
        assert torch.autograd.gradcheck(lambda a, b: custom_op.rms_norm(a, [37], b), (x, w))
    else:
        assert torch.autograd.gradcheck(lambda a: custom_op.rms_norm(a, [37], None), (x,))


def test_multi_dim_normalized_shape():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: custom_op.rms_norm(a, (4, 5), b, 1e-6), (x, w))
    y_op, rstd_op = torch.ops.torchgraft.rms_norm_triton_fwd(x.detach(), [4, 5], w.detach(), None)
    y_ref, rstd_ref = rms_norm_reference(x.detach(), [4, 5], w.detach(), None)
    assert rstd_op.shape == rstd_ref.shape == (2, 3, 1, 1)
    assert rel_err(y_op, y_ref) < 1e-12 and rel_err(rstd_op, rstd_ref) < 1e-12


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_empty_input_gives_atens_outputs(shape):
    # Nothing to launch: rstd and the gradients are still filled as aten fills them (rstd NaN
    # over an empty row, zero gradients), never left uninitialised. aten has no CPU kernel
    # for the fused op; the float64 reference computes what its CUDA kernel returns.
    normalized = [shape[-1]]
    x = torch.randn(shape)
    w = torch.randn(normalized)
    y, rstd = torch.ops.torchgraft.rms_norm_triton_fwd(x, normalized, w, None)
    y_ref, rstd_ref = rms_norm_reference(x, normalized, w, None)
    assert y.shape == y_ref.shape and rstd.shape == rstd_ref.shape
    torch.testing.assert_close(rstd, rstd_ref, equal_nan=True, check_dtype=False)
    dy = torch.randn(shape)
    dx, dw = torch.ops.torchgraft.rms_norm_triton_bwd(dy, x, normalized, rstd, w, True, True)
    dx_ref, dw_ref = rms_norm_backward_reference(dy, x, normalized, rstd_ref, w)
    torch.testing.assert_close(dx, dx_ref, check_dtype=False)
    torch.testing.assert_close(dw, dw_ref, check_dtype=False)


def test_torch_compile_traces_without_graph_breaks():
    def model(x, w):
        return custom_op.rms_norm(x * 2.0, [64], w, 1e-6) + 1.0

    x = torch.randn(8, 64)
    w = torch.randn(64)
    explanation = torch._dynamo.explain(model)(x, w)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    ops = [str(op) for graph_ops in explanation.ops_per_graph for op in graph_ops]
    assert any("rms_norm_triton_fwd" in op for op in ops), ops


def test_bad_input_raises():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        custom_op.rms_norm(x, [5])
    with pytest.raises(RuntimeError, match="weight"):
        custom_op.rms_norm(x, [4], torch.randn(5))
    with pytest.raises(RuntimeError, match="dtype"):
        custom_op.rms_norm(x, [4], torch.randn(4, dtype=torch.float64))
