"""torch 2.14+'s ``F.linear_cross_entropy(options=...)`` served by torchgraft's fused kernel
(the override of ``torch_nn::_linear_cross_entropy_batch_chunked``), on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native, registry
from torchgraft.ops.linear_cross_entropy import registration
from torchgraft.ops.linear_cross_entropy.reference import linear_cross_entropy_reference

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
    pytest.mark.skipif(
        not registration.op_available(),
        reason=f"this torch ({torch.__version__}) has no F.linear_cross_entropy chunked op",
    ),
]

KEY = f"native/torch_nn::{registration.OP_SYMBOL}/CPU"


@pytest.fixture(autouse=True, params=["rows", "two_pass"])
def _scheme(request, monkeypatch):
    """Each test under both schemes of the native op: its row chunks (what batch_chunk_size
    asks for), and the two-pass vocabulary-blocked scheme forced with groups of 64 rows and
    blocks of 48 classes (TORCHGRAFT_LCE_SCHEME)."""
    monkeypatch.setenv("TORCHGRAFT_LCE_SCHEME", "rows" if request.param == "rows" else "64,48")


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


@contextlib.contextmanager
def served() -> Iterator[None]:
    """torchgraft enabled with the override installed: enable() installs it where a GPU is;
    without one, by hand (disable() removes it either way)."""
    with torchgraft.enabled():
        registration.register()
        yield


def options(**kw: Any) -> Any:
    from torch.nn import LinearCrossEntropyOptions

    return LinearCrossEntropyOptions(**kw)


def counters() -> tuple[int, int]:
    entry = torchgraft.stats().get(KEY, {"calls": 0, "fallbacks": 0})
    return entry["calls"], entry["fallbacks"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


def problem(
    dtype: torch.dtype, bias: bool, rows: int = 300, hidden: int = 48, vocab: int = 130
) -> Problem:
    x = torch.randn(rows, hidden, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, dtype=dtype) / hidden**0.5).requires_grad_()
    b = torch.randn(vocab, dtype=dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (rows,))
    target[::7] = -100  # ignored rows
    return x, w, b, target


def reference_grads(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, reduction: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = (x, w) if b is None else (x, w, b)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    xr, wr, *br = leaves
    loss = linear_cross_entropy_reference(xr, wr, target, br[0] if br else None, -100, reduction)
    loss.backward()
    return loss, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float64_reference_and_runs_the_native_kernel(dtype, reduction, bias):
    x, w, b, target = problem(dtype, bias)
    # Compact accumulation in float32: what the kernel does (torch's CPU default for bf16 is
    # "accurate"; "compact" alone would accumulate in bf16).
    acc = torch.float32 if dtype == torch.bfloat16 else None
    opts = options(batch_chunk_size=64, acc_policy="compact", acc_dtype=acc)
    with served():
        loss = F.linear_cross_entropy(
            x, w, target, linear_bias=b, reduction=reduction, options=opts
        )
        loss.backward()
        ran = counters()  # an override's counters go with it at disable()
    assert ran == (1, 0)
    assert loss.dtype == dtype and loss.shape == ()
    ref_loss, ref_grads = reference_grads(x, w, b, target, reduction)
    assert rel_err(loss, ref_loss) < TOL[dtype]
    for got, want in zip([x.grad, w.grad] + ([b.grad] if bias else []), ref_grads, strict=True):
        assert got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype]


def test_gradients_check_in_float64():
    x, w, b, target = problem(torch.float64, True, rows=24, hidden=6, vocab=11)
    opts = options(batch_chunk_size=5, allow_retain_graph=True)

    def f(x, w, b):
        return F.linear_cross_entropy(x, w, target, linear_bias=b, options=opts)

    with served():
        assert torch.autograd.gradcheck(f, (x, w, b))
        assert counters()[0] > 0


def test_only_the_gradients_asked_for_are_computed():
    x, w, _, target = problem(torch.float32, False)
    w.requires_grad_(False)
    with served():
        F.linear_cross_entropy(x, w, target, options=options()).backward()
        assert counters() == (1, 0)
    _, (gx, _) = reference_grads(x, w, None, target, "mean")
    assert w.grad is None and rel_err(x.grad, gx) < TOL[torch.float32]


@pytest.mark.parametrize(
    "case",
    [
        "class weights",
        "bf16 accurate (CPU default)",
        "bf16 accumulation",
        "mixed dtypes",
        "float64 accumulation",
    ],
)
def test_calls_outside_its_cond_get_torchs_own_result(case):
    dtype = torch.bfloat16 if case.startswith("bf16") else torch.float32
    x, w, _, target = problem(dtype, False)
    kwargs = {}
    opts = options(batch_chunk_size=64)
    if case == "class weights":
        kwargs["weight"] = torch.rand(w.shape[0]) + 0.5
    if case == "mixed dtypes":
        w = w.detach().to(torch.bfloat16).requires_grad_()
    if case == "bf16 accumulation":
        opts = options(batch_chunk_size=64, acc_policy="compact")
    if case == "float64 accumulation":
        opts = options(batch_chunk_size=64, acc_dtype=torch.float64)

    def run():
        x.grad = w.grad = None
        loss = F.linear_cross_entropy(x, w, target, options=opts, **kwargs)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    try:
        stock = run()
    except (RuntimeError, ValueError) as e:  # torch refuses the combination: so must we
        with torchgraft.enabled(), pytest.raises(type(e)):
            run()
        return
    with served():
        grafted = run()
        assert counters() == (0, 1)
    for a, b in zip(stock, grafted, strict=True):
        assert torch.equal(a, b)


def test_all_rows_ignored_gives_torchs_result():
    x, w, _, target = problem(torch.float32, False, rows=16)
    target.fill_(-100)
    stock = F.linear_cross_entropy(x, w, target, reduction="sum", options=options())
    with served():
        grafted = F.linear_cross_entropy(x, w, target, reduction="sum", options=options())
        assert counters() == (1, 0)
    assert torch.equal(stock, grafted)


def test_installed_with_the_native_route_where_a_gpu_is_and_removed_by_disable():
    def ours() -> list[str]:
        return [
            o.dispatch_key
            for o in registry.list_overrides()
            if o.op_symbol == registration.OP_SYMBOL and o.dsl == "native"
        ]

    assert ours() == []
    with torchgraft.enabled():
        assert sorted(ours()) == (["CPU", "CUDA"] if torch.cuda.is_available() else [])
    with torchgraft.enabled(routes=["native"]):
        assert sorted(ours()) == (["CPU", "CUDA"] if torch.cuda.is_available() else [])
    with served():
        assert sorted(ours()) == ["CPU", "CUDA"]
    assert ours() == []
    with torchgraft.enabled(routes=["triton"]):  # not the native route: never installed
        assert ours() == []
