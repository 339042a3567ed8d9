"""Random operands for the operand property tests, and the rules that judge a call.

A :class:`Draw` builds one call's tensors from a seed: fresh random values, a base dtype, and
perturbations that each test names with a tag: another dtype for an operand (``dtype``), a size
the op's contract does not take (``shape``), a layout it does not take (``layout``), written
operands that share memory (``overlap``), operands on two devices (``mixed``). Layouts the
kernels must take without a tag: non-contiguous, sliced (gaps), expanded (stride 0), empty. The
same seed and device plan give the same call again (one copy per run: in-place ops write their
operands), and the ``meta`` plan gives the same call on meta tensors.

:func:`judge` compares a call with its reference (see the test modules for who is judged how).
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPES = [*FLOATS, torch.int64, torch.bool, torch.complex64]

# Relative-norm tolerance of a result of this dtype against the float64 (complex128) value.
TOL = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
    torch.complex64: 1e-4,
    torch.complex128: 1e-9,
}

OVERLAP_MESSAGE = "to a single memory location"

# Tags of draws outside an op's contract (what it may refuse with a RuntimeError); a second
# mistake of a kind adds its tag with a "+".
CONTRACT_TAGS = frozenset({"dtype", "shape", "layout", "dtype+", "shape+", "layout+"})


def base_seed() -> int:
    """A fresh seed per run (``TORCHGRAFT_PROPERTY_SEED`` repeats one)."""
    env = os.environ.get("TORCHGRAFT_PROPERTY_SEED")
    return int(env) if env else time.time_ns() % 2**31


def plans() -> list[str]:
    """The device plans draws cycle through: mostly ``cpu``, then ``meta``, ``mixed`` (CPU and
    meta operands) and, with a GPU, ``cuda`` and ``cuda-mixed`` (CPU and CUDA operands)."""
    out = ["cpu", "cpu", "cpu", "meta", "cpu", "mixed", "cpu"]
    if torch.cuda.is_available():
        out += ["cuda", "cuda", "cuda-mixed"]
    return out


class Draw:
    """One call's operands, drawn from ``seed`` on ``plan``'s devices (see :func:`plans`)."""

    def __init__(self, seed: int, plan: str = "cpu") -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.plan = plan
        self.tags: set[str] = set()
        self.dtype = self.rng.choice(FLOATS)
        self.devices: set[str] = set()

    def mistake(self, kind: str) -> None:
        """Tags the draw with a mistake of ``kind`` (``kind+`` for a second one)."""
        self.tags.add(kind + "+" if kind in self.tags else kind)

    # ---------------------------------------------------------------- sizes and dtypes

    def size(self, lo: int = 1, hi: int = 5, empty: float = 0.08) -> int:
        """A size in ``[lo, hi]``, or 0 now and then."""
        return 0 if self.rng.random() < empty else self.rng.randint(lo, hi)

    def shape(self, dims: tuple[int, int] = (1, 3), **size: Any) -> list[int]:
        return [self.size(**size) for _ in range(self.rng.randint(*dims))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, options: Sequence[Any]) -> Any:
        return self.rng.choice(list(options))

    def dtype_of(self, base: torch.dtype | None = None, perturb: float = 0.08) -> torch.dtype:
        """``base`` (the call's dtype by default), or another of :data:`DTYPES` now and then."""
        base = base or self.dtype
        if self.chance(perturb):
            other = self.pick(DTYPES)
            if other != base:
                self.mistake("dtype")
            return other
        return base

    def perturb_shape(self, shape: list[int], p: float = 0.08) -> list[int]:
        """``shape``, or now and then one with a size changed (to 1: it may broadcast)."""
        if not shape or not self.chance(p):
            return shape
        out = list(shape)
        i = self.rng.randrange(len(out))
        out[i] = self.pick([1, out[i] + 1])
        if out != shape:
            self.mistake("shape")
        return out

    # ---------------------------------------------------------------- tensors

    def _device(self) -> str:
        if self.plan == "mixed":
            device = "meta" if self.chance(0.35) else "cpu"
        elif self.plan == "cuda-mixed":
            device = "cpu" if self.chance(0.35) else "cuda"
        else:
            device = self.plan
        self.devices.add(device)
        return device

    def values(self, shape: Sequence[int], dtype: torch.dtype, kind: str = "randn") -> Tensor:
        """Fresh values of ``shape`` on the CPU (drawn whatever the device plan, so that every
        plan consumes the same random stream)."""
        g = self.gen
        if kind == "positive":
            return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        if dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=dtype)
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        if not dtype.is_floating_point:
            return torch.randint(-3, 4, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def tensor(
        self,
        shape: Sequence[int],
        dtype: torch.dtype | None = None,
        *,
        kind: str = "randn",
        written: bool = False,
        layouts: Sequence[str] = ("contiguous", "transposed", "sliced", "expanded"),
        weights: Sequence[float] = (0.55, 0.2, 0.1, 0.15),
    ) -> Tensor:
        """A tensor of ``shape`` in a drawn layout; an expanded written tensor is tagged
        ``overlap`` (its elements share memory)."""
        dtype = dtype or self.dtype
        shape = list(shape)
        layout = self.rng.choices(list(layouts), weights=list(weights)[: len(layouts)])[0]
        wide = [i for i, s in enumerate(shape) if s > 1]
        if (layout == "transposed" and len(shape) < 2) or (layout == "sliced" and not shape):
            layout = "contiguous"
        if layout == "expanded" and not wide:
            layout = "contiguous"
        if layout == "transposed":
            swapped = [*shape[:-2], shape[-1], shape[-2]]
            base, view = self.values(swapped, dtype), (lambda t: t.transpose(-1, -2))
        elif layout == "sliced":
            base = self.values([*shape[:-1], 2 * shape[-1]], dtype)
            view = lambda t: t[..., ::2]  # noqa: E731
        elif layout == "expanded":
            i = self.pick(wide)
            one = [1 if j == i else s for j, s in enumerate(shape)]
            base, view = self.values(one, dtype), (lambda t: t.expand(shape))
            if written:
                self.tags.add("overlap")
        else:
            base, view = self.values(shape, dtype, kind), (lambda t: t)
        return view(self.place(base))

    def place(self, t: Tensor) -> Tensor:
        """``t`` on this draw's device for it (meta: the same sizes, strides and dtype)."""
        device = self._device()
        if device == "meta":
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if device == "cuda":
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
            return out.copy_(t)
        return t

    def target(self, shape: Sequence[int], classes: int, ignore_index: int = -100) -> Tensor:
        """Class indices in ``[0, classes)`` with some rows ignored; now and then another dtype
        (uint8, int32, float, bool: tagged ``dtype``)."""
        ignore = torch.rand(shape, generator=self.gen) < (1.0 if classes == 0 else 0.15)
        t = torch.randint(0, max(classes, 1), shape, generator=self.gen)
        t = torch.where(ignore, torch.full_like(t, ignore_index), t)
        if classes == 0 and self.chance(0.3):
            t = torch.zeros_like(t)  # out of bounds: IndexError, as in ATen
        dtype = torch.int64
        if self.chance(0.08):
            dtype = self.pick([torch.uint8, torch.int32, torch.float32, torch.bool])
            self.mistake("dtype")
            if dtype == torch.uint8:
                t = t.clamp(min=0)
        return self.place(t.to(dtype))


# -------------------------------------------------------------------- running and judging


@dataclass
class Outcome:
    """What a call gave: its result, or the exception it raised."""

    result: Any = None
    error: BaseException | None = None
    devices: set[str] = field(default_factory=set)

    def __str__(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {str(self.error)[:300]}"
        return f"returned {describe(self.result)}"


def run(fn: Callable[[], Any]) -> Outcome:
    """Calls ``fn`` with PyTorch's deterministic mode on: every fresh allocation is filled with
    NaN (the largest integer), so that an element a kernel leaves unwritten shows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        was = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        # warn_only: an op without a deterministic CUDA kernel still runs.
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            result = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return Outcome(result=result)
        except Exception as exc:  # the outcome under test
            return Outcome(error=exc)
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)


def tensors_of(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors_of(item)]
    return []


def describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"Tensor({list(x.shape)}, {x.dtype}, {x.device.type})"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(describe(t) for t in x) + ")"
    return repr(x)


def upcast(x: Any) -> Any:
    """Floating tensors in float64, complex ones in complex128, each a contiguous copy (for the
    exact value: some stock kernels read a strided operand as a flat array)."""
    if isinstance(x, Tensor):
        if x.dtype.is_complex:
            return x.to(torch.complex128).contiguous()
        return x.double().contiguous() if x.dtype.is_floating_point else x
    if isinstance(x, (tuple, list)):
        return type(x)(upcast(t) for t in x)
    return x


def rel_err(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / max(||ref||, floor)`` in float64 (complex128) over the finite reference
    entries; inf if the two disagree on which entries are NaN or infinite."""
    wide = torch.complex128 if out.is_complex() or ref.is_complex() else torch.float64
    o, r = out.detach().to(wide), ref.detach().to(wide)
    if not torch.equal(torch.isfinite(o), torch.isfinite(r)):
        same_nan = torch.isnan(o) == torch.isnan(r)
        same_inf = torch.where(torch.isinf(r), o == r, ~torch.isinf(o))
        if not bool((same_nan & same_inf).all()):
            return math.inf
    finite = torch.isfinite(r)
    o, r = o[finite], r[finite]
    # The operands are of unit scale: a reference far below it comes from terms that cancel,
    # whose roundoff is that of the terms, so the error is relative to 1 per element there.
    floor = math.sqrt(max(r.numel(), 1))
    return float((o - r).abs().norm() / max(float(r.abs().norm()), floor))


def close(out: Any, ref: Any, inputs: Any = (), baseline: Any = None) -> str | None:
    """Why ``out`` is not ``ref`` within the tolerance of the least precise of ``out``'s dtype
    and the floating inputs' (a result computed from bfloat16 operands may round in bfloat16
    along the way, as the eager expression does), or within twice the error of ``baseline``
    (the eager or stock result in the operands' dtypes) where that is larger. None when it is."""
    floating = [t.dtype for t in tensors_of(inputs) if t.dtype in TOL]
    floor = max((TOL[d] for d in floating), default=0.0)
    bases = tensors_of(baseline) if baseline is not None else []
    outs, refs = tensors_of(out), tensors_of(ref)
    if len(outs) != len(refs):
        return f"{len(outs)} tensors, reference has {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if list(o.shape) != list(r.shape):
            return f"output {i}: shape {list(o.shape)}, reference {list(r.shape)}"
        if o.device.type == "meta" or r.device.type == "meta" or o.numel() == 0:
            continue
        if not (o.dtype.is_floating_point or o.dtype.is_complex):
            if not torch.equal(o, r.to(o.dtype)):
                return f"output {i}: integer values differ"
            continue
        err, tol = rel_err(o, r), max(TOL[o.dtype], floor)
        if i < len(bases) and list(bases[i].shape) == list(r.shape):
            base_err = rel_err(bases[i], r)
            tol = max(tol, 2 * base_err) if math.isfinite(base_err) else tol
        if not err <= tol:
            return f"output {i} ({o.dtype}): relative error {err:.3g} > {tol:g}"
    return None


# Exception types the stable ABI cannot raise: a native entry raises RuntimeError for them
# (docs/reliability.md, "Errors").
ABI_LIMITED = (NotImplementedError, IndexError, ValueError, TypeError)


def same_error(ours: BaseException, ref: BaseException, abi_limited: bool) -> bool:
    if type(ours) is type(ref):
        return True
    return abi_limited and type(ours) is RuntimeError and isinstance(ref, ABI_LIMITED)


def judge(
    ours: Outcome,
    ref: Outcome,
    exact: Callable[[], Any] | None,
    tags: set[str],
    inputs: Any,
    *,
    native: bool,
    refuses: set[str] = frozenset(),  # type: ignore[assignment]
) -> str | None:
    """Why ``ours`` is wrong given the reference's outcome ``ref`` (None when it is right).

    - Operands on two devices (``mixed``): a RuntimeError.
    - Written operands that share memory (``overlap``): RuntimeError, with ATen's message unless
      the draw has another mistake; on meta tensors (no memory) anything but garbage.
    - The reference raised: the same exception type (``native``: or RuntimeError where the
      stable ABI cannot raise the reference's type).
    - The reference computed: the same values as ``exact()`` (float64) within the tolerance of
      the result's dtype, the same shapes; or a RuntimeError when the draw has a tag in
      ``refuses`` (what the op's contract does not take).
    """
    if "mixed" in tags:
        # A RuntimeError, or what the eager expression does (a face running it, and ATen lets
        # a 0-dim CPU tensor join tensors of another device).
        if isinstance(ours.error, RuntimeError):
            return None
        if ref.error is not None and type(ours.error) is type(ref.error):
            return None
        if ours.error is not None and tags & CONTRACT_TAGS:
            return None  # another mistake of the call, reported first
        if ours.error is None and ref.error is None and close(ours.result, ref.result) is None:
            return None
        return f"operands on two devices: expected a RuntimeError, {ours}"
    if "overlap" in tags and "meta" in tags:
        return None
    if "overlap" in tags:
        message = str(ours.error)
        if isinstance(ours.error, RuntimeError) and (
            OVERLAP_MESSAGE in message or tags & CONTRACT_TAGS
        ):
            return None
        return f"written operands share memory: expected ATen's RuntimeError, {ours}"
    if ref.error is not None:
        if ours.error is not None and same_error(ours.error, ref.error, native):
            return None
        if ours.error is not None and len(tags & (CONTRACT_TAGS | {"mixed"})) > 1:
            return None  # two mistakes: either may be reported first
        return f"reference {ref}, ours {ours}"
    if ours.error is not None:
        if tags & refuses and type(ours.error) is RuntimeError:
            return None
        return f"reference {ref}, ours {ours}"
    want = exact() if exact is not None else ref.result
    return close(ours.result, want, inputs, baseline=ref.result)
