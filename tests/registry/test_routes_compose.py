"""The Python route composes with the native route: a router's fallback is the native kernel."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from torchgraft import native

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

NATIVE = "native/aten::_fused_rms_norm/CPU"


@pytest.fixture(autouse=True)
def _clean(clean_overrides):
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def big_rows_only(x, normalized_shape, weight, eps):
    return x.shape[0] >= 64


def doubled(x, normalized_shape, weight, eps):
    # Re-enters the op: reaches the kernel below the router (the native one when enabled).
    y, rstd = torch.ops.aten._fused_rms_norm.default(x, normalized_shape, weight, eps)
    return y * 2, rstd


@pytest.mark.parametrize("native_first", [True, False])
def test_router_falls_back_to_the_native_kernel(native_first):
    if native_first:
        torchgraft.enable()
    torchgraft.register_op_override(
        "test", "aten", "_fused_rms_norm", "CPU", big_rows_only, doubled
    )
    if not native_first:
        torchgraft.enable()  # routers are rebuilt on top of the native kernel

    small, big = torch.randn(4, 32), torch.randn(64, 32)
    y_small, _ = torch.ops.aten._fused_rms_norm(small, [32], None, None)
    y_big, _ = torch.ops.aten._fused_rms_norm(big, [32], None, None)
    stats = torchgraft.stats()
    assert stats["test/aten::_fused_rms_norm/CPU"]["calls"] == 1
    # Both the small call (cond false) and the impl's re-entrant call reached the native kernel.
    assert stats[NATIVE]["calls"] == 2

    # The router stays; below it ATen's composite comes back.
    torchgraft.disable()
    ref_small, _ = torch.ops.aten._fused_rms_norm(small, [32], None, None)
    ref_big, _ = torch.ops.aten._fused_rms_norm(big, [32], None, None)
    stats = torchgraft.stats()
    assert stats[NATIVE]["calls"] == 2
    assert stats["test/aten::_fused_rms_norm/CPU"]["calls"] == 2
    torch.testing.assert_close(y_small, ref_small)
    torch.testing.assert_close(y_big, ref_big)  # both doubled by the override
