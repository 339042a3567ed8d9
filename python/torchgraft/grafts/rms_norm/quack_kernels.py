"""quack's CuteDSL RMSNorm (quack-kernels, module ``quack``) on 2-D rows.

Importing this module imports quack and with it CuteDSL; the impls in :mod:`.dsl_impl`
import it on their first call, never at registration. quack compiles a kernel per (dtype,
hidden size) on first use. Rows are ``(rows, hidden)`` contiguous tensors; ``rstd`` has one
float32 value per row.
"""

from __future__ import annotations

from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from torch import Tensor

__all__ = ["backward", "forward"]


def forward(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of the rows of ``x``; ``y`` in ``x``'s dtype."""
    y, _residual, rstd = rmsnorm_fwd(x, weight, eps=eps, store_rstd=True)
    return y, rstd


def backward(
    grad_out: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """``(dx, dw)``; ``dw`` (None without a weight) is summed in float32, cast to the weight's
    dtype."""
    dx, dw, _db, _dresidual = rmsnorm_bwd(x, weight, grad_out, rstd)
    return dx, dw
