"""Shape checks shared by the reference, the impls and the custom ops (aten's messages)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["check_weight_shape", "empty_rstd", "rows_and_hidden", "rstd_shape"]


def rows_and_hidden(x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, hidden)`` of ``x`` normalized over its trailing ``normalized_shape`` dims.

    Raises aten's RuntimeError when the trailing dims of ``x`` are not ``normalized_shape``.
    """
    n_dims = len(normalized_shape)
    if (
        n_dims == 0
        or x.dim() < n_dims
        or list(x.shape[x.dim() - n_dims :]) != list(normalized_shape)
    ):
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
            f"[*, {', '.join(str(s) for s in normalized_shape)}], but got input of size "
            f"{list(x.shape)}"
        )
    hidden = 1
    for s in normalized_shape:
        hidden *= s
    return (x.numel() // hidden if hidden else 0), hidden


def check_weight_shape(weight: Tensor | None, normalized_shape: Sequence[int]) -> None:
    """Raises aten's RuntimeError when ``weight`` is not shaped ``normalized_shape``."""
    if weight is not None and list(weight.shape) != list(normalized_shape):
        raise RuntimeError(
            f"Expected weight to be of same shape as normalized_shape, but got weight of "
            f"shape {list(weight.shape)} and normalized_shape = {list(normalized_shape)}"
        )


def rstd_shape(x: Tensor, normalized_shape: Sequence[int]) -> list[int]:
    """The shape aten gives ``rstd``: the leading dims of ``x`` and a 1 per normalized dim."""
    n_dims = len(normalized_shape)
    return list(x.shape[: x.dim() - n_dims]) + [1] * n_dims


def empty_rstd(x: Tensor, normalized_shape: Sequence[int]) -> Tensor:
    """An uninitialised ``rstd`` as aten returns it for ``x`` (:func:`rstd_shape`), float32
    (float64 for float64 ``x``), contiguous."""
    shape = rstd_shape(x, normalized_shape)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(shape, dtype=dtype)
