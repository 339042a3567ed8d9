"""quack's and the Helion RMSNorm routes, on CPU: the config table, the conds, and the Helion
kernels themselves (the Triton code Helion generates, run in Triton's interpreter with the
shipped configs) through the ATen-format impls and ATen's autograd."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from torchgraft import registry
from torchgraft.dsl import helion as helion_dsl
from torchgraft.grafts.rms_norm import (
    dsl_cond,
    dsl_impl,
    helion_configs,
    rms_norm_backward_reference,
    rms_norm_reference,
)

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

needs_helion = pytest.mark.skipif(
    helion_dsl.runtime.unusable_reason() is not None,
    reason=f"helion unusable here: {helion_dsl.runtime.unusable_reason()}",
)


def _old_interpreter() -> bool:
    import importlib.metadata

    from torch._vendor.packaging.version import Version

    try:
        return Version(importlib.metadata.version("triton")) < Version("3.7")
    except importlib.metadata.PackageNotFoundError:
        return True


# The backward's inner loop runs between bounds computed in the kernel (a block of rows);
# Triton 3.6's interpreter cannot iterate such a range (compiled Triton can). torch 2.13's
# Triton (3.7) runs it, so these tests run in the main environment.
needs_interpreter_ranges = pytest.mark.skipif(
    not torch.cuda.is_available() and _old_interpreter(),
    reason="Triton < 3.7's interpreter cannot run a loop over in-kernel bounds",
)


# ---- the config table -------------------------------------------------------------------------


def test_choose_takes_the_smallest_tuned_size_that_covers_the_call(monkeypatch):
    entries = tuple(
        helion_configs.Entry("forward", group, hidden, json.dumps({"block_sizes": [hidden]}))
        for group in ("16bit", "float32")
        for hidden in (1024, 4096)
    )
    monkeypatch.setattr(helion_configs, "_entries", lambda: entries)
    pick = helion_configs.choose
    assert pick("forward", torch.bfloat16, 512) == '{"block_sizes": [1024]}'
    assert pick("forward", torch.float16, 1024) == '{"block_sizes": [1024]}'
    assert pick("forward", torch.float32, 2048) == '{"block_sizes": [4096]}'
    assert pick("forward", torch.bfloat16, 8192) == '{"block_sizes": [4096]}'  # the largest
    assert pick("backward", torch.bfloat16, 1024) is None  # Helion's default


def test_committed_configs_are_well_formed():
    entries = helion_configs.load_entries()
    assert {(e.kernel, e.dtypes) for e in entries} == {
        (kernel, group) for kernel in ("forward", "backward") for group in ("16bit", "float32")
    }
    for entry in entries:
        assert isinstance(json.loads(entry.config), dict) and entry.hidden > 0
        if helion_dsl.runtime.unusable_reason() is None:
            import helion

            assert isinstance(helion.Config.from_json(entry.config), helion.Config)


def test_a_bad_config_file_means_helion_defaults(tmp_path, caplog):
    path = tmp_path / "configs.json"
    path.write_text('{"configs": [{"kernel": "forward"}]}')
    with caplog.at_level(logging.WARNING):
        assert helion_configs.load_entries(path) == ()
    assert "unusable" in caplog.text


# ---- conds ------------------------------------------------------------------------------------


def test_dsl_conds_decline_cpu_tensors():
    x = torch.randn(8, 64)
    w = torch.randn(64)
    rstd = torch.randn(8, 1)
    assert not dsl_cond.quack_forward_cond(x, [64], w, None)
    assert not dsl_cond.quack_backward_cond(x, x, [64], rstd, w, [True, True])
    assert not dsl_cond.helion_forward_cond(x, [64], w, None)
    assert not dsl_cond.helion_backward_cond(x, x, [64], rstd, w, [True, True])


@pytest.mark.parametrize(
    ("dtype", "hidden", "major", "fits"),
    [
        (torch.bfloat16, 4096, 9, True),
        (torch.float16, 4098, 10, True),
        (torch.float32, 4097, 9, True),
        (torch.bfloat16, 4097, 9, False),  # odd: a 16-bit vector copy, which cp.async lacks
        (torch.bfloat16, 4096, 8, False),  # Ampere
        (torch.bfloat16, 256 * 1024, 9, False),
    ],
)
def test_quack_limits(monkeypatch, dtype, hidden, major, fits):
    monkeypatch.setattr(dsl_cond, "device_capability", lambda index: (major, 0))
    x = torch.empty(0, dtype=dtype)
    assert dsl_cond._quack_fits(x, hidden) == fits


def test_helion_needs_a_weight():
    x = torch.randn(8, 64)
    assert not dsl_cond.helion_forward_cond(x, [64], None, None)


# ---- the Helion kernels (generated Triton, interpreted on CPU) --------------------------------


def grad_errors(dx, dw, grad, x, w, rstd_ref, dx_ref, dw_ref) -> tuple[float, float]:
    """Errors of dx and dw measured against the size of the terms they sum (both cancel), as
    the Triton kernels' tests do."""
    hidden = x.shape[-1]
    g = grad.double() * w.double()
    xhat = (x.double() * rstd_ref).reshape(-1, hidden)
    dx_scale = (g * rstd_ref).norm()
    dw_scale = (grad.double().reshape(-1, hidden) * xhat).abs().sum(0).norm()
    dx_err = (
        float((dx.double() - dx_ref).norm() / max(dx_ref.norm(), dx_scale))
        if dx is not None
        else 0.0
    )
    dw_err = (
        float((dw.double() - dw_ref).norm() / max(dw_ref.norm(), dw_scale))
        if dw is not None
        else 0.0
    )
    return dx_err, dw_err


HELION_CASES = [
    ((37, 64), torch.float32),
    # Regression: a row length that is not a power of two (Helion padded the mean's divisor).
    ((9, 100), torch.float32),
    ((3, 5, 100), torch.bfloat16),
    ((16, 256), torch.float16),
]


def _helion_forward(shape, dtype):
    hidden = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    y, rstd = dsl_impl.helion_forward_impl(x, [hidden], w, 1e-5)
    return x, w, y, rstd


@needs_helion
@pytest.mark.parametrize(("shape", "dtype"), HELION_CASES)
def test_helion_forward_matches_the_reference(shape, dtype):
    x, w, y, rstd = _helion_forward(shape, dtype)
    y_ref, rstd_ref = rms_norm_reference(x, [shape[-1]], w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert rstd.dtype == torch.float32 and list(rstd.shape) == [*shape[:-1], 1]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y, y_ref) < tolerance and rel_err(rstd, rstd_ref) < 1e-5


@needs_helion
@needs_interpreter_ranges
@pytest.mark.parametrize(("shape", "dtype"), HELION_CASES)
def test_helion_backward_matches_the_reference(shape, dtype):
    hidden = shape[-1]
    x, w, _, rstd = _helion_forward(shape, dtype)
    _, rstd_ref = rms_norm_reference(x, [hidden], w, 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    grad = torch.randn_like(x)
    for mask in ([True, True], [True, False], [False, True]):
        dx, dw = dsl_impl.helion_backward_impl(grad, x, [hidden], rstd, w, mask)
        dx_ref, dw_ref = rms_norm_backward_reference(grad, x, [hidden], rstd_ref, w, mask)
        assert (dx is None) == (not mask[0]) and (dw is None) == (not mask[1])
        assert dx is None or (dx.dtype == dtype and dx.shape == x.shape)
        assert dw is None or (dw.dtype == dtype and dw.shape == w.shape)
        dx_err, dw_err = grad_errors(dx, dw, grad, x, w, rstd_ref, dx_ref, dw_ref)
        assert dx_err < tolerance and dw_err < tolerance


@needs_helion
@needs_interpreter_ranges
def test_helion_backward_sums_dw_over_many_row_blocks(monkeypatch):
    # A config with small row blocks: dw comes from several partial sums, reduced in order.
    monkeypatch.setattr(
        dsl_impl.HELION.get(),
        "choose",
        lambda kernel, dtype, hidden: (
            '{"block_sizes": [8, 4]}' if kernel == "backward" else '{"block_sizes": [4]}'
        ),
    )
    x = torch.randn(45, 32)
    w = torch.randn(32)
    grad = torch.randn_like(x)
    y, rstd = dsl_impl.helion_forward_impl(x, [32], w, None)
    dx, dw = dsl_impl.helion_backward_impl(grad, x, [32], rstd, w, [True, True])
    y_ref, rstd_ref = rms_norm_reference(x, [32], w, None)
    dx_ref, dw_ref = rms_norm_backward_reference(grad, x, [32], rstd_ref, w, [True, True])
    assert rel_err(y, y_ref) < 1e-5
    dx_err, dw_err = grad_errors(dx, dw, grad, x, w, rstd_ref, dx_ref, dw_ref)
    assert dx_err < 1e-5 and dw_err < 1e-5
    dx2, dw2 = dsl_impl.helion_backward_impl(grad, x, [32], rstd, w, [True, True])
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)  # no atomics: run to run identical


@needs_helion
@needs_interpreter_ranges
def test_helion_route_under_aten_autograd():
    x = torch.randn(4, 6, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    grad = torch.randn(4, 6, 48)
    # The float64 reference first, through ATen's own composite.
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    F.rms_norm(x64, [48], w64, 1e-6).backward(grad.double())
    # Registered at CPU, the impls run under F.rms_norm through ATen's derivative formula.
    for op, impl in (
        ("_fused_rms_norm", dsl_impl.helion_forward_impl),
        ("_fused_rms_norm_backward", dsl_impl.helion_backward_impl),
    ):
        registry.register_op_override("helion", "aten", op, "CPU", lambda *a: True, impl)
    y = F.rms_norm(x, [48], w, 1e-6)
    y.backward(grad)
    stats = registry.override_stats()
    assert stats["helion/aten::_fused_rms_norm/CPU"]["calls"] == 1
    assert stats["helion/aten::_fused_rms_norm_backward/CPU"]["calls"] == 1
    assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5
