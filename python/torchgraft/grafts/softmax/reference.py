"""Softmax and log-softmax in float64, forward and backward: the reference the native grafts
are tested against.

Computed from elementary ops as ATen's kernels compute them (the maximum over the dim, the sum of
exponentials of the shifted values, then the outputs), so special values come out as ATen's do:
a slice holding NaN or +inf, or only -inf, is all NaN.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["softmax_backward_reference", "softmax_reference"]


def softmax_reference(x: Tensor, dim: int, log: bool = False) -> Tensor:
    """``softmax(x, dim)`` (``log``: ``log_softmax``) in float64, unrounded."""
    x = x.double()
    if x.dim() == 0:
        return softmax_reference(x.reshape(1), 0, log).reshape(())
    m = x.amax(dim, keepdim=True)
    shifted = x - m
    total = shifted.exp().sum(dim, keepdim=True)
    return shifted - total.log() if log else shifted.exp() / total


def softmax_backward_reference(grad: Tensor, output: Tensor, dim: int, log: bool = False) -> Tensor:
    """The input's gradient from the output's (``grad``) and the forward's ``output``, in
    float64: ``output * (grad - sum(grad * output))`` (softmax) or
    ``grad - exp(output) * sum(grad)`` (log-softmax)."""
    g, y = grad.double(), output.double()
    if g.dim() == 0:
        return softmax_backward_reference(g.reshape(1), y.reshape(1), 0, log).reshape(())
    if log:
        return g - y.exp() * g.sum(dim, keepdim=True)
    return y * (g - (g * y).sum(dim, keepdim=True))
