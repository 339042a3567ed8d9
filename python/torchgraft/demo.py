"""``torchgraft demo``: a Llama-style transformer block, stock and with torchgraft.

The block (two ``nn.RMSNorm``, causal attention through ``F.scaled_dot_product_attention``, a
SwiGLU MLP) runs forward and backward with stock PyTorch, then unchanged inside
``torchgraft.enabled()``. The demo prints which grafts ran, how far the results are from
stock's (PASS/FAIL against the dtype's tolerance), and how much faster the grafted block is.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgraft
from torchgraft.bench.counters import fired, graft_counters
from torchgraft.bench.routes import torchgraft_route_unavailable
from torchgraft.bench.timing import measure

__all__ = ["DemoSize", "LlamaBlock", "run_demo"]

# Relative-norm difference to stock allowed per dtype: two correct implementations differ
# by a few roundings of their RMSNorm, carried through the block's matmuls.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}


@dataclass(frozen=True)
class DemoSize:
    """The block's width and the activation it runs on."""

    dim: int
    heads: int
    hidden: int
    batch: int
    seq: int


CPU_SIZE = DemoSize(dim=256, heads=4, hidden=704, batch=4, seq=128)
CUDA_SIZE = DemoSize(dim=1024, heads=8, hidden=2816, batch=8, seq=1024)


class LlamaBlock(nn.Module):
    """Pre-norm transformer block as in Llama: RMSNorm, causal attention, RMSNorm, SwiGLU."""

    def __init__(self, dim: int, heads: int, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (batch, seq, dim) -> (batch, seq, dim)."""
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (
            w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for w in (
                self.wq,
                self.wk,
                self.wv,
            )
        )
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def build_block(
    size: DemoSize, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """The block with seeded weights (norm weights near 1, not 1, so their gradients matter)."""
    gen = torch.Generator().manual_seed(seed)
    block = LlamaBlock(size.dim, size.heads, size.hidden)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return block.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class StepResult:
    """Output and gradients of one forward + backward."""

    output: Tensor
    grad_input: Tensor
    grad_weights: dict[str, Tensor]


def make_step(
    block: nn.Module, size: DemoSize, device: torch.device, dtype: torch.dtype, seed: int = 1
) -> Callable[[], StepResult]:
    """A forward + backward of ``block`` on fixed random input and output gradient."""
    gen = torch.Generator().manual_seed(seed)
    shape = (size.batch, size.seq, size.dim)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad_out = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    names, params = zip(*block.named_parameters(), strict=True)

    def step() -> StepResult:
        y = block(x)
        grads = torch.autograd.grad(y, (x, *params), grad_out)
        return StepResult(y.detach(), grads[0], dict(zip(names, grads[1:], strict=True)))

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@dataclass(frozen=True)
class Difference:
    """How far one grafted result is from stock's."""

    what: str
    max_abs: float
    rel: float


def compare(grafted: StepResult, stock: StepResult) -> list[Difference]:
    """Output, input gradient and the worst weight gradient, each against stock."""
    weights = [
        (name, _max_abs(g, stock.grad_weights[name]), _rel(g, stock.grad_weights[name]))
        for name, g in grafted.grad_weights.items()
    ]
    worst = max(weights, key=lambda w: w[2])
    return [
        Difference(
            "output", _max_abs(grafted.output, stock.output), _rel(grafted.output, stock.output)
        ),
        Difference(
            "input gradient",
            _max_abs(grafted.grad_input, stock.grad_input),
            _rel(grafted.grad_input, stock.grad_input),
        ),
        Difference(
            f"weight gradients ({len(weights)}; worst {worst[0]})",
            max(w[1] for w in weights),
            worst[2],
        ),
    ]


def _time_stock_vs_grafted(
    run: Callable[[], object],
    routes: Sequence[str] | None,
    device: torch.device,
    rounds: int,
    per_round: int = 4,
) -> tuple[float, float]:
    """Median ms of ``run`` stock and grafted, alternating rounds so machine noise hits both."""
    stock: list[float] = []
    grafted: list[float] = []
    for _ in range(rounds):
        for switch, sink in (
            (torchgraft.disable, stock),
            (lambda: torchgraft.enable(routes), grafted),
        ):
            switch()
            run()  # warm-up after switching
            _sync(device)
            for _ in range(per_round):
                t0 = time.perf_counter()
                run()
                _sync(device)
                sink.append((time.perf_counter() - t0) * 1e3)
    torchgraft.disable()
    return statistics.median(stock), statistics.median(grafted)


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _why_nothing_fired(routes: Sequence[str] | None, device: torch.device) -> str:
    names = list(routes) if routes is not None else list(torchgraft.control.ROUTES)
    reasons = [(name, torchgraft_route_unavailable(name, device)) for name in names]
    found = [f"{name}: {reason}" for name, reason in reasons if reason is not None]
    return "; ".join(found) or "no graft applies to this block's calls"


def run_demo(
    device: torch.device,
    dtype: torch.dtype | None = None,
    routes: Sequence[str] | None = None,
    rounds: int = 5,
    out: TextIO | None = None,
) -> int:
    """Runs the demo, printing to ``out`` (stdout); returns 0 on PASS, 1 on FAIL."""
    out = out if out is not None else sys.stdout
    dtype = (
        dtype if dtype is not None else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    size = CUDA_SIZE if device.type == "cuda" else CPU_SIZE

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    say("torchgraft demo: a Llama-style block (nn.RMSNorm, causal SDPA attention, SwiGLU MLP)")
    say(
        f"  {_describe_device(device)}, {str(dtype).removeprefix('torch.')}, dim {size.dim}, "
        f"{size.heads} heads, MLP {size.hidden}, batch {size.batch} x seq {size.seq}; "
        f"torch {torch.__version__}"
    )
    block = build_block(size, device, dtype)
    step = make_step(block, size, device, dtype)

    was_enabled = torchgraft.is_enabled()
    torchgraft.disable()
    try:
        stock = step()
        _sync(device)
        with torchgraft.enabled(routes=routes):
            before = graft_counters()
            grafted = step()
            _sync(device)
            ran = fired(before, graft_counters())
        say()
        if not any(c.get("calls", 0) for c in ran.values()):
            say(f"FAIL: no graft ran ({_why_nothing_fired(routes, device)})")
            return 1
        say("Grafts that ran in one forward + backward (calls):")
        width = max(len(k) for k in ran)
        for key, counts in sorted(ran.items()):
            extra = f", {counts['fallbacks']} fallbacks" if counts.get("fallbacks") else ""
            say(f"  {key.ljust(width)}  {counts.get('calls', 0)}{extra}")

        tolerance = TOLERANCE[dtype]
        differences = compare(grafted, stock)
        say()
        say(f"Difference to stock PyTorch (relative norm must stay under {tolerance:.0e}):")
        width = max(len(d.what) for d in differences)
        for d in differences:
            verdict = "ok" if d.rel <= tolerance else "TOO LARGE"
            say(f"  {d.what.ljust(width)}  max |diff| {d.max_abs:.2e}  rel {d.rel:.2e}  {verdict}")
        passed = all(d.rel <= tolerance for d in differences)

        say()
        say(f"Speed (median time; the block over {rounds} alternating rounds of 4 runs):")
        stock_ms, graft_ms = _time_stock_vs_grafted(step, routes, device, rounds)
        say(_speed_line("block forward + backward", stock_ms, graft_ms))
        # The norm alone is short: timed like the benchmark (CUDA events on a GPU).
        norm = _rms_norm_step(size, device, dtype)
        stock_ms = measure(norm, device).median_ms
        torchgraft.enable(routes)
        graft_ms = measure(norm, device).median_ms
        say(_speed_line(f"nn.RMSNorm({size.dim}) alone, fwd + bwd", stock_ms, graft_ms))
    finally:
        torchgraft.disable()
        if was_enabled:
            torchgraft.enable()
    say()
    if passed:
        say("PASS: with torchgraft the block computes what stock PyTorch does, within tolerance.")
        return 0
    say("FAIL: torchgraft's results differ from stock PyTorch beyond the tolerance.")
    return 1


def _speed_line(what: str, stock_ms: float, graft_ms: float) -> str:
    return (
        f"  {what:<34} stock {stock_ms:8.3f} ms   torchgraft {graft_ms:8.3f} ms   "
        f"speedup {stock_ms / graft_ms:.2f}x"
    )


def _rms_norm_step(
    size: DemoSize, device: torch.device, dtype: torch.dtype
) -> Callable[[], object]:
    """Forward + backward of one of the block's RMSNorms on its activation, alone."""
    norm = nn.RMSNorm(size.dim, eps=1e-6).to(device=device, dtype=dtype)
    shape = (size.batch, size.seq, size.dim)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, device=device, dtype=dtype)

    def step() -> object:
        return torch.autograd.grad(norm(x), (x, norm.weight), grad_out)

    return step


def main(argv: Sequence[str]) -> int:
    """``torchgraft demo [options]``: parses ``argv``, runs :func:`run_demo`; the exit status."""
    from torchgraft import control
    from torchgraft.cli.args import PROG, CliError, Parser, parse_device, parse_dtype, parse_list

    parser = Parser(prog=f"{PROG} demo")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", help="bf16, fp16, fp32 or fp64 (default: bf16 on CUDA, fp32 on CPU)"
    )
    parser.add_argument("--routes", help="comma-separated torchgraft routes (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (default 5)")
    args = parser.parse_args(list(argv))
    device = parse_device(args.device)
    routes = parse_list(args.routes)
    if routes is not None:
        unknown = [r for r in routes if r not in control.ROUTES]
        if unknown:
            raise CliError(f"unknown route {unknown[0]!r}; known: {', '.join(control.ROUTES)}")
        for route in routes:
            reason = torchgraft_route_unavailable(route, device)
            if reason is not None:
                raise CliError(f"route {route!r} cannot run on {device}: {reason}")
    if args.rounds < 1:
        raise CliError("--rounds must be at least 1")
    return run_demo(device, parse_dtype(args.dtype), routes, rounds=args.rounds)
