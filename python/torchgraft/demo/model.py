"""``torchgraft demo``: a transformers Llama's training step, stock and adopted by torchgraft.

A small ``LlamaForCausalLM`` is built from a config with seeded random weights (nothing is
downloaded). A deep copy is adopted (``torchgraft.adopt``) and runs with ``torchgraft.enable()``;
the original stays stock and runs with torchgraft off. The demo prints the adoption table,
checks that one training step (forward with labels, backward) gives stock's loss and parameter
gradients within the dtype's tolerance, times the step both ways, and shows the top ops of each
by self time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import Tensor, nn

import torchgraft
from torchgraft.bench import model_zoo, patches, timing
from torchgraft.bench.model_variants import watched_namespaces
from torchgraft.bench.op_profile import StepProfile, profile_step

__all__ = ["SIZES", "TOLERANCE", "run_model_demo"]

SIZES: dict[str, model_zoo.Size] = {
    s.name: s
    for s in (
        # name, hidden, layers, heads, kv heads, MLP, vocab, tied, batch, seq, rounds, steps
        model_zoo.Size("tiny", 64, 2, 4, 2, 176, 512, False, 2, 32, 2, 2, "tests: a second"),
        model_zoo.Size("cpu", 256, 2, 4, 2, 704, 16384, False, 1, 512, 5, 2, "2 CPU cores: 30 s"),
        dataclasses.replace(model_zoo.SIZES["1b"], rounds=3, steps=5),
    )
}
"""The demo's shapes (``--size``): ``cpu`` on the CPU and ``1b`` on a GPU by default."""

TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 1e-1,
    torch.float16: 2e-2,
}
"""Largest relative-norm difference to stock allowed for the loss and each gradient. Fused
kernels round (and sum) in another order, and the difference grows through the layers: at the
``cpu`` size the worst gradient differs by about 1e-6 in float32 and 1.3e-2 in bfloat16 (a
k_proj weight, behind RoPE and softmax); the ``1b`` shape has 16 layers, not 2."""

TOP_OPS = 6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: nn.Module, batch: Tensor) -> Tensor:
    """One training step's compute: forward with labels (the batch itself) and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach()


def relative_difference(a: Tensor, b: Tensor) -> float:
    """``|a - b| / |b|`` in float64 (norms over all elements)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@dataclass(frozen=True)
class Check:
    """The grafted step's loss and gradients against stock's."""

    loss_diff: float
    worst_grad: str
    worst_grad_diff: float
    grads: int

    @property
    def max_diff(self) -> float:
        """The largest relative difference of all."""
        return max(self.loss_diff, self.worst_grad_diff)


def compare_step(stock: nn.Module, grafted: nn.Module, stock_loss: Tensor, loss: Tensor) -> Check:
    """Loss and every parameter's gradient (after one step of each model) against stock's."""
    grads = dict(grafted.named_parameters())
    diffs = {
        name: relative_difference(grads[name].grad, p.grad)
        for name, p in stock.named_parameters()
        if p.grad is not None and grads[name].grad is not None
    }
    missing = sum(p.grad is None for p in grafted.parameters())
    if missing:
        diffs[f"{missing} missing gradients"] = float("inf")
    worst = max(diffs, key=diffs.__getitem__)
    return Check(relative_difference(loss, stock_loss), worst, diffs[worst], len(diffs))


def _profile_lines(profile: StepProfile) -> list[str]:
    width = max((len(op.op) for op in profile.ops), default=0)
    return [
        f"    {op.op.ljust(width)}  {op.self_ms:9.2f} ms  {op.share:6.1%}  {op.calls:5d} calls"
        for op in profile.ops
    ]


def run_model_demo(
    device: torch.device,
    size: model_zoo.Size,
    dtype: torch.dtype,
    *,
    rounds: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    out: TextIO | None = None,
) -> int:
    """Runs the demo on ``device``, printing to ``out`` (stdout); 0 on PASS, 1 on FAIL.

    ``rounds`` x ``steps`` timed steps each way (defaults: the size's), after warm-up steps.
    torchgraft's enabled state is the same afterwards as before.
    """
    out = out if out is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} threads"
    )
    say(
        f"torchgraft demo: one training step of a transformers LlamaForCausalLM, stock vs adopted"
        f"\n  {device} ({where}), {str(dtype).removeprefix('torch.')}, size {size.name}: hidden "
        f"{size.hidden}, {size.layers} layers, {size.heads} heads ({size.kv_heads} kv), MLP "
        f"{size.mlp}, vocab {size.vocab}, batch {size.batch} x seq {size.seq}; random weights "
        f"(seed {seed})"
    )
    stock = model_zoo.build_model(
        model_zoo.build_config(size, model_zoo.FAMILIES["llama"]), device, dtype, seed
    )
    grafted = copy.deepcopy(stock)
    batch = model_zoo.make_batches(size, 1, device, seed + 1)[0]
    was_enabled = torchgraft.is_enabled()
    try:
        return _run(stock, grafted, batch, device, dtype, size, rounds, steps, say)
    finally:
        torchgraft.unadopt(grafted)
        torchgraft.disable()
        if was_enabled:
            torchgraft.enable()


def _run(
    stock: nn.Module,
    grafted: nn.Module,
    batch: Tensor,
    device: torch.device,
    dtype: torch.dtype,
    size: model_zoo.Size,
    rounds: int | None,
    steps: int | None,
    say: Callable[[str], None],
) -> int:
    reports: list[object] = []

    def adopt() -> None:
        with torchgraft.enabled():
            reports.append(torchgraft.adopt(grafted))

    # adopt() may replace module-global functions (transformers' apply_rotary_pos_emb): they
    # are installed only around the adopted model's steps, so the stock model runs as shipped.
    recorded = patches.record(watched_namespaces(grafted), adopt)

    def grafted_on() -> AbstractContextManager[None]:
        return _both(torchgraft.enabled(), patches.applied(recorded))

    contenders = {
        "stock": (lambda: train_step(stock, batch), torchgraft.disabled),
        "torchgraft": (lambda: train_step(grafted, batch), grafted_on),
    }
    say()
    with grafted_on():
        say(str(reports[0]))

    losses = {}
    for name, (step, state) in contenders.items():
        with state():
            losses[name] = step()
            _sync(device)
    check = compare_step(stock, grafted, losses["stock"], losses["torchgraft"])
    tolerance = TOLERANCE[dtype]
    passed = check.max_diff <= tolerance
    say()
    say(
        f"Training step, torchgraft vs stock (relative norm of the difference; "
        f"tolerance {tolerance:.0e} for {str(dtype).removeprefix('torch.')}):"
    )
    say(
        f"  loss {losses['torchgraft'].item():.6f} vs {losses['stock'].item():.6f}"
        f"   rel diff {check.loss_diff:.2e}"
    )
    say(
        f"  {check.grads} parameter gradients: max rel diff {check.worst_grad_diff:.2e}"
        f" ({check.worst_grad})"
    )
    say(f"  max relative difference {check.max_diff:.2e}: {'PASS' if passed else 'FAIL'}")

    rounds = rounds or size.rounds
    steps = steps or size.steps
    times = timing.alternating_rounds(
        {name: step for name, (step, _) in contenders.items()},
        device,
        rounds=rounds,
        steps=steps,
        warmup=1,
        around=lambda name: contenders[name][1](),
    )
    stock_ms, graft_ms = (statistics.median(times[name]) for name in contenders)
    say()
    say(
        f"Step time (forward + backward with labels; median of {rounds} alternating rounds "
        f"of {steps} steps):"
    )
    say(
        f"  stock {stock_ms:9.2f} ms   torchgraft {graft_ms:9.2f} ms   "
        f"speedup {stock_ms / graft_ms:.2f}x"
    )

    for name, (step, state) in contenders.items():
        with state():
            profile = profile_step(step, device, top=TOP_OPS)
        say()
        say(f"Top {TOP_OPS} ops, {name} ({profile.clock}; step total {profile.total_ms:.1f} ms):")
        for line in _profile_lines(profile):
            say(line)
    say()
    if passed:
        say("PASS: the adopted model trains like stock PyTorch, within tolerance.")
        return 0
    say("FAIL: torchgraft's loss or gradients differ from stock PyTorch beyond the tolerance.")
    return 1


@contextlib.contextmanager
def _both(
    first: AbstractContextManager[None], second: AbstractContextManager[None]
) -> Iterator[None]:
    with first, second:
        yield
