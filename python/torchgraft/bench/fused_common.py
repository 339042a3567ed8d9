"""Pieces the benchmarks of torchgraft's fused ops share (swiglu, geglu, rope, the losses).

Each of those ops has its own module beside :mod:`.rms_norm`, with the same interface; this
module holds what they all need: the tolerances, the random inputs, the availability of the
torchgraft and Liger routes, torch.compile per problem, and the normalisation of Liger's loss
outputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchgraft import native

from .routes import RouteUnavailable, module_available

__all__ = [
    "ELEMENTWISE_PASSES",
    "IGNORE_INDEX",
    "TOLERANCE",
    "TORCHGRAFT_GRAFTS",
    "at_least_float32",
    "compiled",
    "default_dtype",
    "liger_attr",
    "liger_unavailable",
    "loss_tensor",
    "make_generator",
    "make_target",
    "randn",
    "torchgraft_unavailable",
]

ELEMENTWISE_PASSES = {"fwd": 1, "fwd+bwd": 2}
"""Passes over memory (kernels) a fused elementwise op's mode takes at least: the forward's,
then the backward's (an op module's PASSES, for its memory floor)."""

IGNORE_INDEX = -100
"""The losses' ``ignore_index`` (PyTorch's and transformers' default)."""

# Relative-norm error against the float64 reference that a correct route stays under: a few
# roundings to the output dtype (eager composites round after each of their ops).
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 5e-3,
}

TORCHGRAFT_GRAFTS = "native/torchgraft::"
"""Prefix of the counters of torchgraft's own operators (``native/torchgraft::swiglu/CPU``)."""


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 when its dtype is narrower (the upcast models make before a loss or a
    norm), else ``t`` itself: a float64 baseline computes in float64."""
    return t if t.dtype == torch.float64 else t.float()


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs (what models train in), float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on ``device`` (the same inputs on every run)."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    scale: float = 1.0,
) -> Tensor:
    """Standard normal values times ``scale``, drawn in float32 and rounded to ``dtype``."""
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return (t * scale if scale != 1.0 else t).to(dtype)


def make_target(
    rows: int, classes: int, device: torch.device, gen: torch.Generator, ignored_every: int = 8
) -> Tensor:
    """Random int64 class indices, one row in ``ignored_every`` set to :data:`IGNORE_INDEX`
    (as padding is in a language-model batch)."""
    target = torch.randint(0, classes, (rows,), generator=gen, device=device)
    target[::ignored_every] = IGNORE_INDEX
    return target


def torchgraft_unavailable(device: torch.device) -> str | None:
    """Why ``torchgraft.functional``'s ops cannot run here (they need the native extension)."""
    if not native.available():
        return "the extension torchgraft._native is not built"
    return None


def liger_unavailable(device: torch.device) -> str | None:
    """Why Liger-Kernel's routes cannot run on ``device`` (Triton kernels: CUDA only)."""
    if not module_available("liger_kernel"):
        return "Liger-Kernel is not installed (module 'liger_kernel' not found)"
    return None if device.type == "cuda" else "runs on CUDA devices only"


def liger_attr(module: str, name: str) -> Any:
    """``liger_kernel.<module>.<name>``, or :class:`RouteUnavailable` saying why not."""
    try:
        return getattr(importlib.import_module(f"liger_kernel.{module}"), name)
    except (ImportError, AttributeError) as e:
        raise RouteUnavailable(f"liger_kernel.{module}.{name} is not importable: {e}") from e


def loss_tensor(out: Any) -> Tensor:
    """The loss of a Liger loss call: a tensor, a tuple whose first item is the loss, or an
    output object with a ``loss`` field (the return type changed between Liger versions)."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.loss


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False)`` with a fresh dynamo cache (one static graph per
    problem, no recompile limit to hit)."""
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)
