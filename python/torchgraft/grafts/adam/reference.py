"""One Adam / AdamW step in float64: the reference the native ``_fused_adam(w)_`` grafts are
tested against.

:func:`adam_step_reference` follows ``torch.optim.Adam`` / ``AdamW`` (the update that ATen's fused
kernels compute) on float64 copies of the tensors and returns the new values unrounded, so a
kernel's error can be measured. ``rounded=True`` rounds each result to its tensor's dtype, the
last rounding every kernel makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AdamConfig", "AdamState", "adam_step_reference"]


@dataclass(frozen=True)
class AdamConfig:
    """The hyper-parameters of ``aten::_fused_adam(w)_``."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    eps: float = 1e-8
    amsgrad: bool = False
    maximize: bool = False
    adamw: bool = True
    grad_scale: float | None = None


@dataclass
class AdamState:
    """One parameter's tensors (updated values, or the inputs of a step)."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    max_exp_avg_sq: Tensor | None = None


def adam_step_reference(
    state: AdamState, step: float, cfg: AdamConfig, rounded: bool = False
) -> AdamState:
    """The state after one step at step count ``step`` (already incremented), in float64.

    ``grad`` comes back unscaled (divided by ``cfg.grad_scale``) as the fused kernels store it.
    """
    p = state.param.double()
    g = state.grad.double()
    m = state.exp_avg.double()
    v = state.exp_avg_sq.double()
    if cfg.grad_scale is not None:
        g = g / cfg.grad_scale
    g_out = g
    if cfg.maximize:
        g = -g
    if cfg.weight_decay != 0:
        if cfg.adamw:
            p = p * (1 - cfg.lr * cfg.weight_decay)
        else:
            g = g + cfg.weight_decay * p
    m = cfg.beta1 * m + (1 - cfg.beta1) * g
    v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
    bias_correction1 = 1 - cfg.beta1**step
    bias_correction2 = 1 - cfg.beta2**step
    mx = None
    second = v
    if cfg.amsgrad:
        assert state.max_exp_avg_sq is not None, "amsgrad needs max_exp_avg_sq"
        mx = torch.maximum(state.max_exp_avg_sq.double(), v)
        second = mx
    denom = second.sqrt() / math.sqrt(bias_correction2) + cfg.eps
    p = p - (cfg.lr / bias_correction1) * m / denom
    out = AdamState(p, g_out, m, v, mx)
    if rounded:
        out = AdamState(
            p.to(state.param.dtype),
            g_out.to(state.grad.dtype),
            m.to(state.exp_avg.dtype),
            v.to(state.exp_avg_sq.dtype),
            None if mx is None else mx.to(state.exp_avg_sq.dtype),
        )
    return out
