"""The RMSNorm benchmark: its routes, default shapes, bytes moved, inputs and reference.

RMSNorm normalizes over the last dim: ``y = x * rsqrt(mean(x**2, -1) + eps) * weight``.
Every route computes that (forward, and backward through autograd) from the same inputs, and
each is checked against a float64 reference before it is timed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgraft import control

from .problem import ShapedProblem
from .routes import (
    Route,
    RouteUnavailable,
    always_available,
    module_available,
    stock_dispatch,
    torch_native_active,
    torch_native_dispatch,
    torchgraft_dispatch,
    torchgraft_route_unavailable,
)

__all__ = ["BASELINE", "EPS", "MODES", "OP", "PEAK_MEMORY", "Problem", "RmsNormFn", "routes"]

OP = "rms_norm"
OP_SYMBOLS = ("_fused_rms_norm", "_fused_rms_norm_backward")
EPS = 1e-6
MODES = ("fwd", "fwd+bwd")
"""``fwd``: the forward alone; ``fwd+bwd``: forward, then backward to the input and weight."""
BASELINE = "aten"
"""The route the table's speedups are against."""
PEAK_MEMORY = False
"""Whether each call's extra peak memory is recorded (CUDA only)."""

RmsNormFn = Callable[[Tensor, Tensor], Tensor]
"""``fn(x, weight) -> y``, normalizing over the last dim of ``x``."""

# Relative-norm error against the float64 reference that a correct route stays under: a few
# roundings to the output dtype (the Llama-style eager route rounds twice).
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


@dataclass(frozen=True)
class Problem(ShapedProblem):
    """One benchmark problem: an input shape (normalized over its last dim), dtype, device."""

    @property
    def hidden(self) -> int:
        """Size of the normalized (last) dim."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Number of rows normalized independently."""
        return math.prod(self.shape[:-1])


# ---- shapes ----------------------------------------------------------------------------------

HEADLINE_SHAPE = (8, 4096, 4096)
"""Batch 8 x sequence 4096 x hidden 4096: a Llama-scale activation."""


def default_shapes(device: torch.device, quick: bool) -> list[tuple[int, ...]]:
    """The sweep run when ``--shapes`` is not given (rows x hidden, plus the headline shape)."""
    if quick:
        return [(256, 1024), (1024, 1024)] if device.type == "cpu" else [(4096, 1024), (4096, 4096)]
    if device.type == "cpu":
        return [(rows, hidden) for hidden in (1024, 4096) for rows in (256, 1024, 4096)]
    sweep = [(rows, hidden) for hidden in (1024, 2048, 4096, 8192) for rows in (1024, 4096, 16384)]
    return [*sweep, HEADLINE_SHAPE]


def check_shape(shape: tuple[int, ...]) -> str | None:
    """Why ``shape`` cannot be normalized over its last dim (any shape can), or None."""
    return None


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs (what models train in), float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def bytes_moved(problem: Problem, mode: str) -> int:
    """Bytes an ideal kernel moves to and from memory (rstd's 4 bytes per row left out).

    Forward: read x and weight, write y. Backward: read x, dy and weight, write dx and dw.
    """
    size = problem.rows * problem.hidden * problem.dtype.itemsize
    weight = problem.hidden * problem.dtype.itemsize
    forward = 2 * size + weight
    return forward if mode == "fwd" else forward + 3 * size + 2 * weight


# ---- inputs, reference, running a route --------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """A problem's input, weight and output gradient (random, fixed seed)."""

    x: Tensor
    weight: Tensor
    grad_out: Tensor


def make_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """Random inputs of the problem's dtype on its device; the weight is near 1, not 1."""
    gen = torch.Generator(device=problem.device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        t = torch.randn(shape, generator=gen, device=problem.device, dtype=torch.float32)
        return t.to(problem.dtype)

    weight = (1 + 0.1 * randn(problem.hidden).float()).to(problem.dtype)
    return Inputs(x=randn(*problem.shape), weight=weight, grad_out=randn(*problem.shape))


def reference(inputs: Inputs, mode: str) -> list[Tensor]:
    """Float64 results of ``mode``: ``[y]`` or ``[y, dx, dweight]``."""
    x = inputs.x.double()
    weight = inputs.weight.double()
    hidden = [x.shape[-1]]
    try:
        from torchgraft.grafts.rms_norm.reference import (
            rms_norm_backward_reference,
            rms_norm_reference,
        )
    except ImportError:
        return _reference_autograd(x, weight, inputs.grad_out.double(), mode)
    y, rstd = rms_norm_reference(x, hidden, weight, EPS)
    if mode == "fwd":
        return [y]
    dx, dw = rms_norm_backward_reference(inputs.grad_out.double(), x, hidden, rstd, weight)
    assert dx is not None and dw is not None
    return [y, dx, dw]


def _reference_autograd(x: Tensor, weight: Tensor, grad_out: Tensor, mode: str) -> list[Tensor]:
    # Used until torchgraft.grafts.rms_norm.reference is part of this checkout.
    x = x.detach().requires_grad_(mode != "fwd")
    weight = weight.detach().requires_grad_(mode != "fwd")
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight
    if mode == "fwd":
        return [y.detach()]
    dx, dw = torch.autograd.grad(y, (x, weight), grad_out)
    return [y.detach(), dx, dw]


def run_once(fn: RmsNormFn, inputs: Inputs, mode: str) -> list[Tensor]:
    """The route's results for ``mode``, in the order :func:`reference` returns them."""
    if mode == "fwd":
        with torch.no_grad():
            return [fn(inputs.x, inputs.weight)]
    x = inputs.x.detach().requires_grad_()
    weight = inputs.weight.detach().requires_grad_()
    y = fn(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), inputs.grad_out)
    return [y.detach(), dx, dw]


def timed_call(fn: RmsNormFn, inputs: Inputs, mode: str) -> Callable[[], object]:
    """A no-argument callable running ``mode`` once (what the timer calls)."""
    if mode == "fwd":

        def forward() -> object:
            with torch.no_grad():
                return fn(inputs.x, inputs.weight)

        return forward
    x = inputs.x.detach().requires_grad_()
    weight = inputs.weight.detach().requires_grad_()
    grad_out = inputs.grad_out

    def forward_backward() -> object:
        return torch.autograd.grad(fn(x, weight), (x, weight), grad_out)

    return forward_backward


# ---- the routes ------------------------------------------------------------------------------


def _eager_upcast_fallback(x: Tensor, weight: Tensor, eps: float = EPS) -> Tensor:
    # Used until torchgraft.grafts.rms_norm.reference is part of this checkout.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def _eager_function() -> RmsNormFn:
    """Llama-style eager RMSNorm: float32 math, cast back, then scale (several kernels);
    float64 math for float64 input (Llama would round it to float32: no baseline to measure)."""
    try:
        from torchgraft.grafts.rms_norm.reference import (
            rms_norm_eager_same_dtype,
            rms_norm_eager_upcast,
        )
    except ImportError:
        rms_norm_eager_upcast = rms_norm_eager_same_dtype = _eager_upcast_fallback

    def eager(x: Tensor, weight: Tensor) -> Tensor:
        if x.dtype == torch.float64:
            return rms_norm_eager_same_dtype(x, weight, EPS)
        return rms_norm_eager_upcast(x, weight, EPS)

    return eager


def _functional(x: Tensor, weight: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def _build_functional(_problem: Problem) -> RmsNormFn:
    return _functional


def _build_eager(_problem: Problem) -> RmsNormFn:
    return _eager_function()


def _build_compile(_problem: Problem) -> RmsNormFn:
    import torch._dynamo

    # A fresh cache per problem: one static-shape graph each, and no recompile limit to hit.
    torch._dynamo.reset()
    return torch.compile(_eager_function(), dynamic=False)


def _build_triton_op(_problem: Problem) -> RmsNormFn:
    from torchgraft.grafts.rms_norm import rms_norm

    def triton_op(x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, (x.shape[-1],), weight, EPS)

    return triton_op


def _build_liger(_problem: Problem) -> RmsNormFn:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        raise RouteUnavailable(f"liger_kernel.ops.rms_norm is not importable: {e}") from e

    def liger(x: Tensor, weight: Tensor) -> Tensor:
        # offset 0, Llama casting, and dy left intact (the benchmark reuses it).
        return LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)

    return liger


def _cuda_only(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "runs on CUDA devices only"


def _triton_op_unavailable(device: torch.device) -> str | None:
    if importlib.util.find_spec("torchgraft.ops") is None or (
        importlib.util.find_spec("torchgraft.grafts.rms_norm") is None
    ):
        return "torchgraft.grafts.rms_norm is not part of this torchgraft"
    if not module_available("triton"):
        return "triton is not installed (module 'triton' not found)"
    return _cuda_only(device)


def _liger_unavailable(device: torch.device) -> str | None:
    if not module_available("liger_kernel"):
        return "Liger-Kernel is not installed (module 'liger_kernel' not found)"
    return _cuda_only(device)


def _torch_native_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "torch._native overrides RMSNorm on CUDA only"
    if importlib.util.find_spec("torch._native") is None:
        return f"torch {torch.__version__} has no torch._native (added in 2.12)"
    if not torch_native_active("_fused_rms_norm", "CUDA"):
        return "torch._native has no active RMSNorm override (needs nvidia-cutlass-dsl)"
    return None


def routes() -> tuple[Route, ...]:
    """Every RMSNorm route, in table order (baselines first)."""
    stock = functools.partial(stock_dispatch, OP_SYMBOLS)
    found = [
        Route(
            "eager",
            "Llama-style composite: x.float(), pow, mean, rsqrt, mul, cast, * weight",
            always_available,
            _build_eager,
            stock,
        ),
        Route(
            "aten",
            "F.rms_norm with torchgraft off: ATen's fused kernel (the composite on CPU)",
            always_available,
            _build_functional,
            stock,
        ),
        Route(
            "compile",
            "torch.compile of the eager composite (static shapes)",
            always_available,
            _build_compile,
            stock,
        ),
    ]
    for name in control.ROUTES:
        found.append(
            Route(
                f"torchgraft-{name}",
                f"F.rms_norm inside torchgraft.enabled(routes=[{name!r}])",
                functools.partial(torchgraft_route_unavailable, name),
                _build_functional,
                functools.partial(torchgraft_dispatch, name, OP_SYMBOLS),
                graft_prefix=f"{name}/",
            )
        )
    found += [
        Route(
            "torchgraft-triton-op",
            "torchgraft.grafts.rms_norm.rms_norm: the Triton kernels as a custom op, every size",
            _triton_op_unavailable,
            _build_triton_op,
            stock,
        ),
        Route(
            "liger",
            "Liger-Kernel's LigerRMSNormFunction (Llama casting)",
            _liger_unavailable,
            _build_liger,
            stock,
        ),
        Route(
            "torch-native",
            "F.rms_norm with torch._native's own override (CuteDSL/quack)",
            _torch_native_unavailable,
            _build_functional,
            torch_native_dispatch,
        ),
    ]
    return tuple(found)
