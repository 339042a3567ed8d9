"""Which ``aten::_fused_rms_norm`` / ``_fused_rms_norm_backward`` calls quack's CuteDSL
kernels, the Helion kernels and the cuTile kernels take.

The inputs the Triton kernels take (:func:`.triton_cond.problem_size`,
:func:`.triton_cond.backward_inputs_fit`), narrowed by what each library does, with no size gate
of their own: these routes are opt-in (``torchgraft.enable(routes=["cutedsl"])`` /
``["helion"]`` / ``["cutile"]``), and where they run they run for every shape they can. Once a
library's import has failed, its conds decline every call.

* quack: a Hopper or Blackwell GPU (sm90/sm100), a hidden size whose rows split into 32- to
  128-bit vector copies (even for 16-bit dtypes), at most 128K; weight optional.
* Helion: a weight, a hidden size up to 8192 (the kernels hold a row in registers; at 16384 a
  call did not finish compiling in 4 minutes on the H100, Helion 1.4.0).
* cuTile: a weight, a hidden size up to 16384 (a row is one tile of the next power of two), and
  a GPU the found tileiras compiles for (:func:`torchgraft.dsl.cutile.arch_unusable_reason`:
  Hopper from tileiras 13.3).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import Tensor

from torchgraft.common.device import device_capability
from torchgraft.dsl import cutile

from .dsl_impl import CUTILE, HELION, QUACK
from .triton_cond import backward_inputs_fit, problem_size

__all__ = [
    "CUTILE_MAX_HIDDEN",
    "HELION_MAX_HIDDEN",
    "QUACK_MAX_HIDDEN",
    "cutile_backward_cond",
    "cutile_forward_cond",
    "helion_backward_cond",
    "helion_forward_cond",
    "quack_backward_cond",
    "quack_forward_cond",
]

QUACK_MAX_HIDDEN = 128 * 1024
QUACK_ARCHS = frozenset({9, 10})
HELION_MAX_HIDDEN = 8192
CUTILE_MAX_HIDDEN = 16384


def _quack_fits(x: Tensor, n_cols: int) -> bool:
    # quack copies rows in vectors of gcd(n, 128 / bits) elements; cp.async takes 32-128 bits.
    bits = x.element_size() * 8
    return (
        0 < n_cols <= QUACK_MAX_HIDDEN
        and (n_cols * bits) % 32 == 0
        and device_capability(x.device.index)[0] in QUACK_ARCHS
    )


def quack_forward_cond(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> bool:
    """True when quack's forward should run this ``aten::_fused_rms_norm`` call."""
    return not QUACK.failed and _quack_fits(input, problem_size(input, normalized_shape, weight))


def quack_backward_cond(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> bool:
    """True when quack's backward should run this ``aten::_fused_rms_norm_backward`` call."""
    n_cols = problem_size(input, normalized_shape, weight)
    return (
        not QUACK.failed
        and _quack_fits(input, n_cols)
        and backward_inputs_fit(grad_out, input, rstd, input.numel() // n_cols)
    )


def helion_forward_cond(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> bool:
    """True when the Helion forward should run this ``aten::_fused_rms_norm`` call."""
    if HELION.failed or weight is None:
        return False
    return 0 < problem_size(input, normalized_shape, weight) <= HELION_MAX_HIDDEN


def helion_backward_cond(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> bool:
    """True when the Helion backward should run this ``aten::_fused_rms_norm_backward`` call."""
    if HELION.failed or weight is None:
        return False
    n_cols = problem_size(input, normalized_shape, weight)
    return 0 < n_cols <= HELION_MAX_HIDDEN and backward_inputs_fit(
        grad_out, input, rstd, input.numel() // n_cols
    )


@functools.cache
def _cutile_compiles_for(major: int) -> bool:
    return cutile.arch_unusable_reason(major) is None


def _cutile_fits(x: Tensor, n_cols: int) -> bool:
    return 0 < n_cols <= CUTILE_MAX_HIDDEN and _cutile_compiles_for(
        device_capability(x.device.index)[0]
    )


def cutile_forward_cond(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None
) -> bool:
    """True when the cuTile forward should run this ``aten::_fused_rms_norm`` call."""
    if CUTILE.failed or weight is None:
        return False
    return _cutile_fits(input, problem_size(input, normalized_shape, weight))


def cutile_backward_cond(
    grad_out: Tensor,
    input: Tensor,
    normalized_shape: Sequence[int],
    rstd: Tensor,
    weight: Tensor | None,
    output_mask: Sequence[bool],
) -> bool:
    """True when the cuTile backward should run this ``aten::_fused_rms_norm_backward`` call."""
    if CUTILE.failed or weight is None:
        return False
    n_cols = problem_size(input, normalized_shape, weight)
    return _cutile_fits(input, n_cols) and backward_inputs_fit(
        grad_out, input, rstd, input.numel() // n_cols
    )
