"""The Triton RMSNorm on a CUDA GPU: kernels, impls and custom op against the float64
reference and aten, torch.compile with Inductor, and (when torchgraft's registry is present)
the graft through F.rms_norm. Skipped without CUDA; not run under TRITON_INTERPRET=1.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from torchgraft.grafts.rms_norm import rms_norm_backward_reference, rms_norm_reference
from torchgraft.grafts.rms_norm import triton_cond as cond
from torchgraft.grafts.rms_norm import triton_impl as impl

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this run"
    ),
]

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(out, ref, scale=None):
    den = ref.double().norm()
    if scale is not None:
        den = torch.maximum(den, scale.double().norm())
    return ((out.double() - ref.double()).norm() / den).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1000, 4096, 5120, 16384, 20000])
@pytest.mark.parametrize("with_weight", [True, False])
def test_impls_match_reference_and_aten(dtype, n, with_weight):
    shape = (3, 67, n)
    x = torch.randn(shape, dtype=dtype, device="cuda")
    dy = torch.randn(shape, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda") if with_weight else None
    y, rstd = impl.fused_rms_norm_impl(x, [n], w, 1e-6)
    y_aten, rstd_aten = torch.ops.aten._fused_rms_norm(x, [n], w, 1e-6)
    for ours, theirs in ((y, y_aten), (rstd, rstd_aten)):
        assert (ours.shape, ours.dtype, ours.stride()) == (
            theirs.shape,
            theirs.dtype,
            theirs.stride(),
        )
    y_ref, rstd_ref = rms_norm_reference(x, [n], w, 1e-6)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(rstd, rstd_ref) < TOL[torch.float32]

    dx, dw = impl.fused_rms_norm_backward_impl(dy, x, [n], rstd, w, [True, True])
    dx_ref, dw_ref = rms_norm_backward_reference(dy, x, [n], rstd_ref, w)
    g = dy.double() * (w.double() if w is not None else 1.0)
    assert rel_err(dx, dx_ref, scale=g * rstd_ref) < TOL[dtype]
    if with_weight:
        assert dw.dtype == dtype and dw.shape == w.shape
        assert rel_err(dw, dw_ref) < TOL[dtype]
    else:
        assert dw is None


def test_backward_is_deterministic():
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn_like(x)
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    _, rstd = impl.fused_rms_norm_impl(x, [4096], w, 1e-6)
    first = impl.fused_rms_norm_backward_impl(dy, x, [4096], rstd, w, [True, True])
    second = impl.fused_rms_norm_backward_impl(dy, x, [4096], rstd, w, [True, True])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_custom_op_gradcheck_float64_on_gpu():
    from torchgraft.grafts.rms_norm import rms_norm

    x = torch.randn(3, 5, 37, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(37, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, [37], b), (x, w))


def test_custom_op_under_torch_compile_inductor():
    from torchgraft.grafts.rms_norm import rms_norm

    def model(x, w):
        return rms_norm(x * 2.0, [512], w, 1e-6).float().square().sum()

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    assert torch._dynamo.explain(model)(x, w).graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True)
    loss_c = compiled(x, w)
    grads_c = torch.autograd.grad(loss_c, (x, w))
    loss_e = model(x, w)
    grads_e = torch.autograd.grad(loss_e, (x, w))
    assert rel_err(loss_c, loss_e) < 1e-3
    for gc, ge in zip(grads_c, grads_e, strict=True):
        assert rel_err(gc, ge) < 1e-2


def test_cond_on_real_tensors():
    x = torch.randn(8, 4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    assert cond.fused_rms_norm_cond(x, [4096], w, None)
    assert not cond.fused_rms_norm_cond(x, [4096], w.float(), None)
    assert not cond.fused_rms_norm_cond(x[:, :, :2048], [2048], None, None)


def _kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {event.name for event in prof.events()}


def test_graft_through_registry():
    pytest.importorskip("torchgraft.dsl", reason="torchgraft's registry is not on this branch")
    from torchgraft.grafts.rms_norm import deregister, register

    x = torch.randn(8, 4096, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def step():
        y = F.rms_norm(x, [4096], w, 1e-6)
        return y, torch.autograd.grad(y.float().sum(), (x, w))

    register()
    try:
        (y, grads), names = _kernel_names(step)
    finally:
        deregister()
    assert any("_rms_norm_fwd_kernel" in n for n in names), names
    assert any("_rms_norm_bwd_kernel" in n for n in names), names
    _, names_after = _kernel_names(step)
    ours = ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_dw_reduce_kernel")
    assert not any(k in n for n in names_after for k in ours), names_after

    y_ref, rstd_ref = rms_norm_reference(x.detach(), [4096], w.detach(), 1e-6)
    assert rel_err(y, y_ref) < 1e-2
    dx_ref, dw_ref = rms_norm_backward_reference(
        torch.ones_like(x), x.detach(), [4096], rstd_ref, w.detach()
    )
    assert rel_err(grads[0], dx_ref, scale=w.double() * rstd_ref) < 1e-2
    assert rel_err(grads[1], dw_ref) < 1e-2
