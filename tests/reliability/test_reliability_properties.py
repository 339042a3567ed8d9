"""Property test of the native CPU grafts against a float64 reference (issue 10).

Hypothesis draws 1000 fresh cases per run: shape, dtype, memory layout, weight (none, same
dtype, strided), eps (None or a value), input scale and which inputs require grad. Each case runs
the grafted forward (and backward when something requires grad) and compares with RMSNorm
computed in float64 from the same (rounded) inputs. The forward must be within the dtype's
output rounding (a relative-norm tolerance); a gradient within that, plus the rounding error any
implementation in the accumulation dtype makes on the terms that cancel in it (when eps is tiny
next to the mean square, dx is a small difference of large terms): a few units of roundoff of
the accumulation dtype times the size of those terms, plus the dtype's subnormal spacing (a
float16 gradient of 2e-8 is 0 in float16). Zero mismatches are allowed; a failure prints the
drawn case so it can be replayed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("hypothesis")  # in the dev environment (Makefile); optional elsewhere

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import torchgraft
from torchgraft import native

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Relative-norm tolerance of an output rounded to the dtype (a few ulps of accumulated error).
TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last", "offset"]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    batch = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    normalized = draw(st.lists(st.integers(1, 48), min_size=1, max_size=2))
    if draw(st.booleans()):  # the common case: a single, wider normalized dim
        normalized = [draw(st.integers(1, 700))]
    return {
        "batch": batch,
        "normalized": normalized,
        "dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "weight": draw(st.sampled_from(["none", "same", "strided"])),
        "eps": draw(st.one_of(st.none(), st.floats(1e-8, 1e-2))),
        "scale": draw(st.sampled_from([1e-3, 1.0, 30.0])),
        "grad": draw(st.sampled_from(["none", "input", "weight", "both"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def make(sizes: list[int], layout: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Fresh random values in `layout` (a view whose strides are not the contiguous ones)."""

    def rand(shape: list[int]) -> torch.Tensor:
        return torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype)

    dim = len(sizes)
    if layout == "transposed" and dim >= 2:
        return rand(sizes[::-1]).permute(*reversed(range(dim)))
    if layout == "sliced" and dim >= 1:
        return rand([*sizes[:-1], 2 * sizes[-1]])[..., ::2]
    if layout == "expanded" and dim >= 2:
        return rand([1, *sizes[1:]]).expand(*sizes)
    if layout == "channels_last" and dim == 4:
        return rand(sizes).to(memory_format=torch.channels_last)
    if layout == "offset":
        n = max(1, torch.Size(sizes).numel())
        return rand([n + 3])[3:].view(sizes) if torch.Size(sizes).numel() else rand(sizes)
    return rand(sizes)


def reference(x: torch.Tensor, ns: list[int], w: torch.Tensor | None, eps: float) -> torch.Tensor:
    dims = list(range(x.dim() - len(ns), x.dim()))
    y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    return y if w is None else y * w


def gradient_terms(
    x: torch.Tensor, ns: list[int], w: torch.Tensor | None, eps: float, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitudes that dx and dw are sums and differences of (in float64)."""
    inner = list(range(x.dim() - len(ns), x.dim()))
    outer = list(range(x.dim() - len(ns)))
    rstd = torch.rsqrt(x.square().mean(inner, keepdim=True) + eps)
    x_hat = x * rstd
    g = dy if w is None else dy * w
    dx = rstd * (g.abs() + x_hat.abs() * (x_hat * g).abs().mean(inner, keepdim=True))
    dw = (dy * x_hat).abs().sum(outer) if outer else (dy * x_hat).abs()
    return dx, dw


@pytest.fixture(scope="module", autouse=True)
def _enabled():
    torchgraft.disable()
    torchgraft.enable(routes=["native"])
    yield
    torchgraft.disable()


@settings(
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
@example(  # a float16 gradient below float16's smallest subnormal
    case={
        "batch": [],
        "normalized": [1],
        "dtype": torch.float16,
        "layout": "contiguous",
        "weight": "none",
        "eps": 0.0078125,
        "scale": 30.0,
        "grad": "input",
        "seed": 0,
    }
)
def test_grafted_rms_norm_matches_a_float64_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, ns = case["dtype"], case["normalized"]
    x = make(case["batch"] + ns, case["layout"], dtype, gen) * case["scale"]
    w = None
    if case["weight"] != "none":
        w = make(ns, "sliced" if case["weight"] == "strided" else "contiguous", dtype, gen)
    eps = case["eps"]
    x.requires_grad_(case["grad"] in ("input", "both"))
    if w is not None:
        w.requires_grad_(case["grad"] in ("weight", "both"))

    y = F.rms_norm(x, ns, w, eps)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    eps_ref = torch.finfo(acc).eps if eps is None else float(torch.tensor(eps, dtype=acc))
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    y64 = reference(x64, ns, w64, eps_ref)
    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    assert error(y, y64) <= tol * y64.double().norm(), case

    wants = [t for t in (x, w) if t is not None and t.requires_grad]
    if not wants or y.numel() == 0:
        return
    dy = make(list(y.shape), "contiguous", dtype, gen)
    grads = torch.autograd.grad(y, wants, dy)
    grads64 = torch.autograd.grad(y64, [x64 if t is x else w64 for t in wants], dy.double())
    w_terms = None if w64 is None else w64.detach()
    terms_dx, terms_dw = gradient_terms(x64.detach(), ns, w_terms, eps_ref, dy.double())
    roundoff = 8 * torch.finfo(acc).eps * torch.Size(ns).numel() ** 0.5
    for got, want, t in zip(grads, grads64, wants, strict=True):
        terms = terms_dx if t is x else terms_dw
        assert got.dtype == dtype and got.shape == want.shape
        # ... and an output too small for the dtype rounds to its nearest subnormal (or 0).
        info = torch.finfo(dtype)
        underflow = info.smallest_normal * info.eps * want.numel() ** 0.5
        allowed = 4 * tol * want.norm() + roundoff * terms.norm() + underflow
        assert error(got, want) <= allowed, case


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref.detach().double()).norm())
