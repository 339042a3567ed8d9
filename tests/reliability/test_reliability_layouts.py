"""Output layouts of the native grafts against torch's own meta functions, over many layouts.

The native route computes the strides ATen's meta functions would give (issue 10, item 5) in
Rust; these tests hold it to torch's answer on permuted, sliced, expanded, channels-last,
size-1 and empty inputs, and check that a grafted call imports no Python machinery.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest
import torch

import torchgraft
from torchgraft import native

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FWD = torch.ops.aten._fused_rms_norm.default
BWD = torch.ops.aten._fused_rms_norm_backward.default


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.dtype, tuple(t.shape), t.stride())


def strided(sizes: list[int], rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `sizes` with a random layout: permuted storage, a sliced dim, an expanded
    size-1 dim, or channels-last memory."""
    dim = len(sizes)
    kind = rng.choice(["contiguous", "permuted", "sliced", "expanded", "channels_last"])
    if kind == "permuted" and dim >= 2:
        order = list(range(dim))
        rng.shuffle(order)
        base = torch.randn([sizes[d] for d in order], dtype=torch.float64).to(dtype)
        inverse = [order.index(d) for d in range(dim)]
        return base.permute(inverse)
    if kind == "sliced" and dim >= 1:
        d = rng.randrange(dim)
        wide = list(sizes)
        wide[d] = sizes[d] * 2
        base = torch.randn(wide, dtype=torch.float64).to(dtype)
        return base[(slice(None),) * d + (slice(None, None, 2),)]
    if kind == "expanded" and dim >= 1:
        d = rng.randrange(dim)
        small = list(sizes)
        small[d] = 1
        return torch.randn(small, dtype=torch.float64).to(dtype).expand(*sizes)
    if kind == "channels_last" and dim in (4, 5):
        fmt = torch.channels_last if dim == 4 else torch.channels_last_3d
        return torch.randn(sizes, dtype=torch.float64).to(dtype).to(memory_format=fmt)
    return torch.randn(sizes, dtype=torch.float64).to(dtype)


def random_sizes(rng: random.Random) -> list[int]:
    dim = rng.randint(1, 5)
    return [
        rng.choice([0, 1, 1, 2, 3, 5]) if rng.random() < 0.25 else rng.randint(1, 6)
        for _ in range(dim)
    ]


CASES = list(range(400))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_layouts_match_the_meta_functions(dtype):
    rng = random.Random(1234 if dtype == torch.float32 else 4321)
    mismatches = []
    with torchgraft.enabled():
        for case in CASES:
            sizes = random_sizes(rng)
            normalized = rng.randint(1, len(sizes))
            x = strided(sizes, rng, dtype)
            ns = list(x.shape[len(x.shape) - normalized :])
            w = strided(ns, rng, dtype) if rng.random() < 0.6 else None
            y, rstd = FWD(x, ns, w, 1e-5)
            y_meta, rstd_meta = FWD(meta(x), ns, None if w is None else meta(w), 1e-5)
            dy = strided(list(x.shape), rng, dtype)
            dx, _ = BWD(dy, x, ns, rstd, w, [True, False])
            dx_meta, _ = BWD(
                meta(dy), meta(x), ns, meta(rstd), None if w is None else meta(w), [True, False]
            )
            got = (layout(y), layout(rstd), layout(dx))
            want = (layout(y_meta), layout(rstd_meta), layout(dx_meta))
            if got != want:
                mismatches.append((case, layout(x), layout(w), layout(dy), got, want))
    assert torchgraft.stats()["native/aten::_fused_rms_norm/CPU"]["calls"] == len(CASES)
    assert not mismatches, f"{len(mismatches)} layouts differ, first: {mismatches[:3]}"


@pytest.mark.parametrize(
    "sizes", [s for n in (3, 4, 5) for s in itertools.product((1, 2, 3), repeat=n)][::7]
)
def test_size_one_dims_in_every_position(sizes):
    # Size-1 dims make strides tie, where TensorIterator's tie-breaking decides the layout.
    rng = random.Random(sum(sizes) * 31 + len(sizes))
    with torchgraft.enabled():
        for _ in range(4):
            x = strided(list(sizes), rng, torch.float32)
            ns = list(x.shape[-1:])
            y, rstd = FWD(x, ns, None, None)
            y_meta, rstd_meta = FWD(meta(x), ns, None, None)
            assert (layout(y), layout(rstd)) == (layout(y_meta), layout(rstd_meta)), layout(x)


def test_a_grafted_call_imports_no_dynamo_and_no_dsl():
    code = (
        "import sys, torch, torchgraft\n"
        "torchgraft.enable(routes=['native'])\n"
        "before = set(sys.modules)\n"
        "x = torch.randn(16, 8).t()\n"  # non-contiguous: the layout path runs
        "y, rstd = torch.ops.aten._fused_rms_norm(x, [16], None, None)\n"
        "dx, dw = torch.ops.aten._fused_rms_norm_backward(y, x, [16], rstd, None, [True, True])\n"
        "new = sorted(m for m in set(sys.modules) - before)\n"
        "print(new)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
