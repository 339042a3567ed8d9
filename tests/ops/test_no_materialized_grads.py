"""Ops with outputs nobody differentiates (a loss's saved gradient, RMSNorm's rstd) get no
zero-filled gradients for them in the backward: autograd would otherwise allocate and fill a
tensor of each such output's size (for the fused linear cross-entropy, one as large as the
lm head's weight) on every step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchgraft import functional as tgf
from torchgraft import native

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="the native extension is not built"),
]


def _ops_in_backward(loss_fn: Callable[[], torch.Tensor]) -> set[str]:
    loss = loss_fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return {event.name for event in prof.events()}


def _cross_entropy() -> torch.Tensor:
    logits = torch.randn(64, 1000, requires_grad=True)
    return tgf.cross_entropy(logits, torch.randint(0, 1000, (64,)))


def _linear_cross_entropy() -> torch.Tensor:
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = (torch.randn(1000, 32) * 0.1).requires_grad_()
    return tgf.linear_cross_entropy(hidden, weight, torch.randint(0, 1000, (64,)))


def _rms_norm() -> torch.Tensor:
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    return (tgf.rms_norm(x, w, 1e-6) * torch.randn(64, 256)).sum()


@pytest.mark.parametrize(
    "loss_fn", [_cross_entropy, _linear_cross_entropy, _rms_norm], ids=lambda f: f.__name__
)
def test_backward_fills_no_zero_gradient(loss_fn):
    ops = _ops_in_backward(loss_fn)
    assert not ops & {"aten::zeros", "aten::zeros_like"}, sorted(ops)
