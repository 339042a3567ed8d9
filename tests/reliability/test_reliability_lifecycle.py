"""Lifecycle promises of torchgraft (issue 10): graphs outlive disable(), enable() is all or
nothing, switching retains no memory, first calls stay cheap, threads and fork are safe."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchgraft
from torchgraft import native, registry

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FWD, BWD = "native/aten::_fused_rms_norm/CPU", "native/aten::_fused_rms_norm_backward/CPU"


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def calls(key: str) -> int:
    return torchgraft.stats()[key]["calls"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def stock_grads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum(rms_norm(x) * cos) through stock PyTorch, in float64."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = F.rms_norm(x64, [x.shape[-1]], w64, 1e-6)
    (y * torch.cos(torch.arange(y.numel(), dtype=torch.float64).view_as(y))).sum().backward()
    return x64.grad, w64.grad


def loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.cos(torch.arange(y.numel(), dtype=y.dtype).view_as(y))).sum()


# ----------------------------------------------------------------- graphs outlive disable()


@pytest.mark.compat
def test_backward_after_disable_runs_the_graph_recorded_while_enabled():
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    with torchgraft.enabled():
        y = F.rms_norm(x, [64], w, 1e-6)
    assert not torchgraft.is_enabled()
    loss(y).backward()  # stock PyTorch has no CPU kernel for the backward op
    assert calls(FWD) == 1 and calls(BWD) == 1
    gx, gw = stock_grads(x, w)
    assert rel_err(x.grad, gx) < 1e-5 and rel_err(w.grad, gw) < 1e-5


def test_a_model_whose_forward_ran_enabled_trains_after_disable():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.RMSNorm(32), torch.nn.Linear(32, 4)
    )
    x = torch.randn(16, 32)
    with torchgraft.enabled():
        out = model(x)
    loss(out).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss(model(x)).backward()  # stock all the way
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert rel_err(got, want) < 1e-5


@pytest.mark.compat
def test_aot_eager_graph_compiled_while_enabled_runs_after_disable():
    torch._dynamo.reset()

    def f(x, w):
        return F.rms_norm(x, [48], w, 1e-6)

    compiled = torch.compile(f, backend="aot_eager")
    x = torch.randn(6, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    with torchgraft.enabled():
        compiled(x, w)  # compiles while enabled
    y = compiled(x, w)  # the same graph, after disable()
    loss(y).backward()
    gx, gw = stock_grads(x, w)
    assert rel_err(x.grad, gx) < 1e-5 and rel_err(w.grad, gw) < 1e-5
    torch._dynamo.reset()


def test_threads_train_while_the_switch_flips_between_rounds():
    # PyTorch's dispatcher does not support changing an operator's registrations while another
    # thread dispatches to it (a kernel can be freed as a thread enters it: a segfault in c10's
    # BoxedKernel, measured on torch 2.11). So the switch flips between rounds, never during one;
    # graphs recorded in an enabled round run their backward in the next (disabled) round.
    inputs = [
        (torch.randn(16, 96).requires_grad_(), torch.randn(96).requires_grad_()) for _ in range(8)
    ]
    expected = [stock_grads(x, w) for x, w in inputs]
    errors: list[BaseException] = []
    wrong: list[int] = []
    recorded: list[torch.Tensor | None] = [None] * len(inputs)

    def train(i: int) -> None:
        x, w = inputs[i]
        try:
            if recorded[i] is not None:  # recorded in the previous round
                gx, gw = torch.autograd.grad(recorded[i], (x, w))
                if rel_err(gx, expected[i][0]) > 1e-4 or rel_err(gw, expected[i][1]) > 1e-4:
                    wrong.append(i)
            for _ in range(10):
                gx, gw = torch.autograd.grad(loss(F.rms_norm(x, [96], w, 1e-6)), (x, w))
                if rel_err(gx, expected[i][0]) > 1e-4 or rel_err(gw, expected[i][1]) > 1e-4:
                    wrong.append(i)
            recorded[i] = loss(F.rms_norm(x, [96], w, 1e-6))
        except BaseException as e:  # every error is a failure to report
            errors.append(e)

    for round_ in range(6):
        (torchgraft.enable if round_ % 2 == 0 else torchgraft.disable)()
        workers = [threading.Thread(target=train, args=(i,)) for i in range(len(inputs))]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
    assert not wrong
    # 3 enabled rounds of 11 forwards per thread; the backwards of the disabled rounds' first
    # graphs (recorded while enabled) ran through the kept CPU backward too.
    assert calls(FWD) == 3 * 11 * len(inputs)
    assert calls(BWD) == 3 * 10 * len(inputs) + 3 * len(inputs)


def test_enable_and_disable_from_many_threads_leave_a_consistent_state():
    stock = dispatch_state()  # CPU backward kept from earlier tests or not: compared below
    errors: list[BaseException] = []

    def toggle(i: int) -> None:
        try:
            for _ in range(30):
                torchgraft.enable() if i % 2 else torchgraft.disable()
                torchgraft.is_enabled()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=toggle, args=(i,)) for i in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
    assert torchgraft.is_enabled() == native.is_enabled()
    torchgraft.disable()
    assert not native.is_enabled()
    assert dispatch_state()[0] == stock[0]  # the forward is stock's again
    x, w = torch.randn(4, 32), torch.randn(32)
    F.rms_norm(x, [32], w, 1e-6)
    assert calls(FWD) == 0


# ----------------------------------------------------------------- enable(): all or nothing


def dispatch_state() -> tuple[str, str]:
    return (
        torch._C._dispatch_dump("aten::_fused_rms_norm"),
        torch._C._dispatch_dump("aten::_fused_rms_norm_backward"),
    )


def test_enable_that_fails_in_the_python_route_leaves_nothing_installed(monkeypatch):
    # Installed once for good (see test above): make sure it is there before comparing.
    with torchgraft.enabled(routes=["native"]):
        pass
    before = dispatch_state()
    monkeypatch.setenv("TORCHGRAFT_OVERRIDE_ORDER_FN", "no.such.module.fn")
    with pytest.raises(ValueError, match="Could not resolve"):
        torchgraft.enable(routes=["native", "triton"])
    assert not torchgraft.is_enabled() and not native.is_enabled()
    assert registry.list_overrides() == []
    assert dispatch_state() == before
    F.rms_norm(torch.randn(4, 8), [8])
    assert calls(FWD) == 0, "a graft ran after a failed enable()"


def test_enable_that_fails_in_the_native_route_removes_the_python_route(monkeypatch):
    with torchgraft.enabled(routes=["native"]):
        pass
    before = dispatch_state()

    def broken(disabled_ops: object = ()) -> None:
        raise RuntimeError("simulated failure while registering the native kernels")

    monkeypatch.setattr(native, "enable", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        torchgraft.enable(routes=["native", "triton"])
    assert not torchgraft.is_enabled()
    assert registry.list_overrides() == []
    assert dispatch_state() == before


@pytest.mark.compat
def test_the_cpu_backward_graft_stays_registered_and_says_so():
    torchgraft.enable(routes=["native"])
    torchgraft.disable()
    state = {(g.op, g.dispatch_key): g.active for g in native.grafts()}
    assert state[("aten::_fused_rms_norm", "CPU")] is False
    assert state[("aten::_fused_rms_norm_backward", "CPU")] is True
    # The forward is stock again, exactly.
    x, w = torch.randn(4, 8, 32), torch.randn(32)
    torch.ops.aten._fused_rms_norm(x, [32], w, 1e-6)
    assert calls(FWD) == 0


# ----------------------------------------------------------------- memory


def test_enable_disable_cycles_retain_no_memory():
    def cycles(n: int) -> None:
        for _ in range(n):
            torchgraft.enable()
            torchgraft.disable()

    cycles(200)  # past one-off growth (caches, torch.library's first registrations)
    gc.collect()
    tracemalloc.start()
    try:
        snapshots = [tracemalloc.take_snapshot()]
        for _ in range(2):
            cycles(500)
            gc.collect()
            snapshots.append(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    # Growth in both windows is a leak; growth in one only is a one-off (a dict resize).
    grown = min(
        sum(s.size_diff for s in after.compare_to(before, "filename"))
        for before, after in itertools.pairwise(snapshots)
    )
    assert grown < 500 * 16, f"{grown / 500:.0f} bytes retained per enable/disable cycle"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_rss_does_not_grow_over_a_hundred_thousand_grafted_calls():
    x = torch.randn(4, 64).requires_grad_()
    w = torch.randn(64).requires_grad_()
    with torchgraft.enabled():
        for _ in range(2000):  # warm up allocator caches
            F.rms_norm(x, [64], w, 1e-5).sum().backward()
        gc.collect()
        rss0 = rss_bytes()
        for _ in range(50_000):  # 5 * 10^4 forward + 5 * 10^4 backward grafted calls
            F.rms_norm(x, [64], w, 1e-5).sum().backward()
        gc.collect()
        rss1 = rss_bytes()
    assert calls(FWD) == 52_000 and calls(BWD) == 52_000
    assert rss1 - rss0 < 2 << 20, f"resident memory grew by {rss1 - rss0} bytes over 10^5 calls"


# ----------------------------------------------------------------- first call, fork


def test_first_grafted_call_costs_at_most_twice_stock_and_imports_nothing():
    bench = Path(__file__).resolve().parents[2] / "bench" / "first_call_latency.py"
    sys.path.insert(0, str(bench.parent))
    try:
        from first_call_latency import sample
    finally:
        sys.path.pop(0)
    # A fresh interpreter per sample (importing torch dominates the test's time); the best of
    # two, as a loaded machine can stall any single call by milliseconds.
    stock = min(float(sample("stock", "transposed")["forward_ms"]) for _ in range(2))
    grafted = [sample("native", "transposed") for _ in range(2)]
    assert all(g["imported"] == [] for g in grafted), grafted
    best = min(float(g["forward_ms"]) for g in grafted)
    # 2x stock, plus a few milliseconds of scheduling noise (the defect was ~1 s).
    assert best <= 2 * stock + 5.0, (grafted, stock)


def _child_computes(queue: multiprocessing.Queue) -> None:
    x, w = torch.randn(8, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    y, _ = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w
    stats = torchgraft.stats()
    queue.put((rel_err(y, ref), stats[FWD]["calls"]))


@pytest.mark.compat
def test_a_forked_child_runs_the_grafts():
    torchgraft.enable(routes=["native"])
    F.rms_norm(torch.randn(64, 1024), [1024])  # the parent's thread pool is up
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_computes, args=(queue,))
    child.start()
    err, child_calls = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert err < 1e-12 and child_calls >= 2
