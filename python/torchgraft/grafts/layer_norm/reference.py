"""LayerNorm in float64, forward and backward: the reference the native grafts are tested
against (``y = (x - mean) * rstd * w + b`` over the trailing ``normalized_shape`` dims, the
population variance, and the gradients of ``native_layer_norm_backward``)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["layer_norm_backward_reference", "layer_norm_reference"]


def _dims(x: Tensor, normalized_shape: list[int]) -> list[int]:
    return list(range(x.dim() - len(normalized_shape), x.dim()))


def layer_norm_reference(
    x: Tensor, normalized_shape: list[int], weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` in float64, mean and rstd shaped like the batch dims and ones."""
    x = x.double()
    dims = _dims(x, normalized_shape)
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).square().mean(dims, keepdim=True)
    rstd = (var + eps).rsqrt()
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y, mean, rstd


def layer_norm_backward_reference(
    grad: Tensor,
    x: Tensor,
    normalized_shape: list[int],
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dw, db)`` in float64 from the saved ``mean`` and ``rstd`` (any shape with one value
    per row)."""
    x, g = x.double(), grad.double()
    dims = _dims(x, normalized_shape)
    batch = x.shape[: x.dim() - len(normalized_shape)]
    stat_shape = (*batch, *([1] * len(normalized_shape)))
    mean = mean.double().reshape(stat_shape)
    rstd = rstd.double().reshape(stat_shape)
    xhat = (x - mean) * rstd
    gw = g * weight.double() if weight is not None else g
    dx = rstd * (gw - gw.mean(dims, keepdim=True) - xhat * (gw * xhat).mean(dims, keepdim=True))
    batch_dims = list(range(len(batch)))
    dw = (g * xhat).sum(batch_dims) if batch_dims else g * xhat
    db = g.sum(batch_dims) if batch_dims else g
    return dx, dw, db
