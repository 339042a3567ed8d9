"""Verification: a layer's own computation and a replacement, run on the same small random probe.

A replacement is adopted only where its outputs and its gradients (with respect to the probe's
inputs and the parameters it reads) agree with the layer's own within the dtype's tolerance, and
have the same shapes and dtypes. Nothing here knows about particular layers: an adopter supplies
the probe cases and how to call each side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
"""Largest relative error (``||replacement - own|| / ||own||``) accepted, per dtype: a few
roundings of the dtype, far below what a different formula gives (e.g. ``weight`` against
``1 + weight``)."""


@dataclass(frozen=True)
class Case:
    """One probe: the arguments, the tensors to differentiate with respect to, and the state the
    layer is put in while both sides run."""

    label: str
    """Shown in reasons, e.g. ``"bfloat16, train"``."""
    args: tuple[object, ...]
    kwargs: dict[str, object] = field(default_factory=dict)
    leaves: tuple[torch.Tensor, ...] = ()
    """Inputs and parameters whose gradients are compared (each requires grad)."""
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    """Parameters of the layer replaced by these while the case runs (random values, so that a
    formula cannot agree by accident of the model's initial weights); list them in ``leaves``
    to compare their gradients."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Buffers of the layer replaced by these while the case runs (e.g. a router's correction
    bias, which the model starts at zeros)."""
    training: bool | None = None
    """The module's mode while the case runs (``None``: as it is)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing two computations over all cases."""

    ok: bool
    max_err: float
    """The largest relative error seen."""
    score: float
    """The largest error as a fraction of its dtype's tolerance (lower agrees better)."""
    reason: str = ""
    """Why it failed (empty when ``ok``)."""


Runner = Callable[[Callable[..., object], Case], object]
"""Calls one side (the layer's own computation or the replacement) on a case."""


def compare(
    own: Callable[..., object],
    replacement: Callable[..., object],
    cases: Sequence[Case],
    run: Runner,
    seed: int = 0,
) -> Verdict:
    """Run ``own`` and ``replacement`` on every case (through ``run``) and compare outputs and
    gradients.

    Upstream gradients are random (from a private generator seeded with ``seed``; the global
    random state is not touched) and the same for both sides.
    """
    max_err, score = 0.0, 0.0
    for case in cases:
        try:
            ref = run(own, case)
        except Exception as e:
            return _failed(f"own forward failed on the probe ({case.label}): {_one_line(e)}")
        try:
            out = run(replacement, case)
        except Exception as e:
            return _failed(f"replacement failed on the probe ({case.label}): {_one_line(e)}")
        ref_t, out_t, why = _tensors(ref, out)
        if why:
            return _failed(f"{why} ({case.label})")
        grads, why = _gradient_pairs(ref_t, out_t, case.leaves, seed)
        if why:
            return _failed(f"{why} ({case.label})")
        outputs = [(f"output {i}", o, r) for i, (o, r) in enumerate(zip(out_t, ref_t, strict=True))]
        for what, o, r in outputs + grads:
            err, tol, why = _distance(o, r)
            if why:
                return _failed(f"{what}: {why} ({case.label})")
            max_err, score = max(max_err, err), max(score, err / tol)
            if err > tol:
                reason = f"{what} differs: relative error {err:.1e} > {tol:.0e} ({case.label})"
                return Verdict(False, max_err, score, reason)
    return Verdict(True, max_err, score)


def _failed(reason: str) -> Verdict:
    return Verdict(False, float("inf"), float("inf"), reason)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _tensors(ref: object, out: object) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """Flattens both results to their tensors; says why they cannot be compared, if so."""
    ref_l = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    out_l = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(ref_l) != len(out_l):
        return [], [], f"returns {len(out_l)} values where the layer returns {len(ref_l)}"
    ref_t: list[torch.Tensor] = []
    out_t: list[torch.Tensor] = []
    for i, (r, o) in enumerate(zip(ref_l, out_l, strict=True)):
        if isinstance(r, torch.Tensor) and isinstance(o, torch.Tensor):
            if r.shape != o.shape or r.dtype != o.dtype:
                return (
                    [],
                    [],
                    (
                        f"output {i} is {o.dtype} {tuple(o.shape)} where the layer "
                        f"gives {r.dtype} {tuple(r.shape)}"
                    ),
                )
            ref_t.append(r)
            out_t.append(o)
        elif isinstance(r, torch.Tensor) or isinstance(o, torch.Tensor) or r != o:
            return [], [], f"output {i} differs in kind or value"
    return ref_t, out_t, ""


Pair = tuple[str, torch.Tensor | None, torch.Tensor | None]


def _gradient_pairs(
    ref: list[torch.Tensor], out: list[torch.Tensor], leaves: tuple[torch.Tensor, ...], seed: int
) -> tuple[list[Pair], str]:
    """Back-propagates the same random upstream gradients through both sides; returns the
    gradient pairs, or why there are none to compare."""
    differentiable = [i for i, r in enumerate(ref) if r.requires_grad and r.is_floating_point()]
    if not leaves or not differentiable:
        return [], ""
    gen = torch.Generator().manual_seed(seed)
    upstream = [
        torch.randn(ref[i].shape, generator=gen, dtype=torch.float32).to(
            ref[i].device, ref[i].dtype
        )
        for i in differentiable
    ]
    outs = [out[i] for i in differentiable]
    if not all(o.requires_grad for o in outs):
        return [], "the replacement's output does not require grad where the layer's does"
    grads_ref = torch.autograd.grad(
        [ref[i] for i in differentiable], leaves, upstream, allow_unused=True
    )
    grads_out = torch.autograd.grad(outs, leaves, upstream, allow_unused=True)
    pairs = zip(grads_out, grads_ref, strict=True)
    return [(f"gradient {i}", o, r) for i, (o, r) in enumerate(pairs)], ""


def _distance(out: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, float, str]:
    """Relative error of ``out`` against ``ref`` (in float64), the tolerance, and any reason the
    two cannot be compared. A missing gradient counts as zeros."""
    if out is None and ref is None:
        return 0.0, 1.0, ""
    like = ref if ref is not None else out
    assert like is not None
    if out is None:
        out = torch.zeros_like(like)
    if ref is None:
        ref = torch.zeros_like(like)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return 0.0, 1.0, f"is {out.dtype} {tuple(out.shape)}, not {ref.dtype} {tuple(ref.shape)}"
    o, r = out.detach().double(), ref.detach().double()
    if not (torch.isfinite(o).all() and torch.isfinite(r).all()):
        return 0.0, 1.0, "non-finite values on the probe"
    tol = TOLERANCE.get(ref.dtype, 0.0)
    diff = float((o - r).norm())
    scale = float(r.norm())
    err = diff / scale if scale > 0 else diff
    return err, tol if tol > 0 else 1e-300, ""


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, params: dict[str, nn.Parameter]) -> Iterator[None]:
    """Temporarily replace some of ``module``'s own parameters; the originals (the same objects)
    are put back on exit."""
    saved = {name: module._parameters[name] for name in params}
    try:
        module._parameters.update(params)
        yield
    finally:
        module._parameters.update(saved)


@contextlib.contextmanager
def swapped_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily replace some of ``module``'s own buffers; the originals (the same objects)
    are put back on exit."""
    saved = {name: module._buffers[name] for name in buffers}
    try:
        module._buffers.update(buffers)
        yield
    finally:
        module._buffers.update(saved)


@contextlib.contextmanager
def training_mode(module: nn.Module, training: bool | None) -> Iterator[None]:
    """Temporarily put ``module`` and its children in train or eval mode (``None``: leave)."""
    if training is None:
        yield
        return
    saved = [(m, m.training) for m in module.modules()]
    try:
        module.train(training)
        yield
    finally:
        for m, was in saved:
            m.training = was


def random_tensor(
    shape: Sequence[int],
    gen: torch.Generator,
    dtype: torch.dtype,
    device: torch.device,
    scale: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """Normal random values from a private CPU generator, then moved: the caller's (and the
    device's) global random state stays untouched."""
    t = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale + offset
    return t.to(device=device, dtype=dtype)
