"""torchgraft under torch.distributed on the CPU (gloo, 2 processes): DDP and FSDP2.

Each worker trains the same tiny model twice from the same seed, stock and with torchgraft
enabled, and reports per-step losses and final gradients; the parent compares them. The model
uses what torchgraft grafts or provides: nn.RMSNorm (aten::_fused_rms_norm) and
torchgraft.functional.swiglu.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dist_helpers import free_port

pytestmark = pytest.mark.default_torch

STEPS = 3
WORLD = 2


class TinyBlock(nn.Module):
    """RMSNorm -> SwiGLU MLP (gate/up/down) with a residual, then a head."""

    def __init__(
        self, hidden: int = 32, inner: int = 48, out: int = 8, fused: bool = False
    ) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.head = nn.Linear(hidden, out, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.fused:
            from torchgraft.functional import swiglu

            act = swiglu(self.gate(h), self.up(h))
        else:
            act = nn.functional.silu(self.gate(h)) * self.up(h)
        return self.head(x + self.down(act))


def _train(mode: str, grafted: bool, rank: int) -> tuple[list[float], dict[str, list[float]]]:
    torch.manual_seed(0)
    model = TinyBlock(fused=grafted)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        wrapped = model
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 6, 32, generator=gen)
        target = torch.randint(0, 8, (4 * 6,), generator=gen)
        loss = nn.functional.cross_entropy(wrapped(x).flatten(0, 1), target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2 shards gradients as DTensors
            g = g.full_tensor()
        # Plain lists: tensors would travel through shared memory that dies with the worker.
        grads[name] = g.detach().flatten().tolist()
    return losses, grads


def _worker(rank: int, port: int, mode: str, out: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import torchgraft

        stock = _train(mode, grafted=False, rank=rank)
        torchgraft.reset_stats()
        with torchgraft.enabled():
            grafted = _train(mode, grafted=True, rank=rank)
        ran = {k: v["calls"] for k, v in torchgraft.stats().items() if v["calls"]}
        out.put((rank, stock, grafted, ran))
        # Both ranks are done talking before either tears gloo down (a rank destroying the
        # group while the other still used it aborted a worker under load). Not on failure:
        # a rank that raised must not wait for one that may never come.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_grafted_training_matches_stock_across_two_processes(mode: str) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, mode, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in range(WORLD)]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    for rank, (stock_losses, stock_grads), (tg_losses, tg_grads), ran in results:
        assert len(stock_losses) == STEPS
        for a, b in zip(stock_losses, tg_losses, strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (rank, stock_losses, tg_losses)
        for name, values in stock_grads.items():
            g, tg = torch.tensor(values), torch.tensor(tg_grads[name])
            err = float((tg - g).norm() / g.norm())
            assert err < 1e-5, (rank, name, err)
        # The grafts ran in every process, in forward and backward.
        assert ran.get("native/aten::_fused_rms_norm/CPU", 0) >= STEPS, ran
        assert ran.get("native/aten::_fused_rms_norm_backward/CPU", 0) >= STEPS, ran
        assert ran.get("native/torchgraft::swiglu/CPU", 0) >= STEPS, ran
    # Data-parallel: every rank ends with the same (all-reduced) gradients.
    first = results[0][2][1]
    for _, _, (_, grads), _ in results[1:]:
        for name, values in grads.items():
            assert values == first[name], name
