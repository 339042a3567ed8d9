"""adopt() under torch.distributed on the CPU (gloo, 2 processes), on a tiny transformers Llama:
adopted before FSDP2's ``fully_shard`` (every layer adopted, no fallback), after it (the layers
whose probe needs the sharded parameters say why they are skipped), with transformers' gradient
checkpointing or each decoder layer compiled (``fullgraph=True``) under FSDP2, and under DDP with
torch's ``checkpoint_wrapper``. Each trains like
the same model without torchgraft, in the same parallel setting, from the same seed."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_helpers import free_port

pytestmark = pytest.mark.default_torch

transformers = pytest.importorskip("transformers")

STEPS = 2
WORLD = 2
VOCAB = 96
SCENARIOS = (
    "fsdp2",
    "fsdp2, adopt before",
    "fsdp2, adopt after",
    "fsdp2 + gradient checkpointing",
    "fsdp2 + gradient checkpointing, adopt before",
    "fsdp2 + regional compile",
    "fsdp2 + regional compile, adopt before",
    "ddp + checkpoint_wrapper",
    "ddp + checkpoint_wrapper, adopt before",
)


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _parallel(model: torch.nn.Module, scenario: str) -> torch.nn.Module:
    if scenario.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        if "gradient checkpointing" in scenario:
            model.gradient_checkpointing_enable()
        for layer in model.model.layers:
            if "regional compile" in scenario:  # torchtitan's order: compile, then shard
                layer.compile(backend="aot_eager", fullgraph=True)
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.nn.parallel import DistributedDataParallel

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    return DistributedDataParallel(model)


def _train(scenario: str, rank: int) -> dict[str, Any]:
    import torchgraft

    model = _model()
    report = None
    if "adopt before" in scenario:
        report = torchgraft.adopt(model)
    wrapped = _parallel(model, scenario)
    if "adopt after" in scenario:
        report = torchgraft.adopt(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    torchgraft.reset_stats()
    with warnings.catch_warnings(record=True) as caught, torchgraft.enabled():
        warnings.simplefilter("always")
        model.train()
        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
            loss = wrapped(input_ids=ids, labels=ids, use_cache=False).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        # Plain lists: tensors would travel through shared memory that dies with the worker.
        grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().flatten().tolist()
    if report is not None:
        torchgraft.unadopt(model)
    return {
        "losses": losses,
        "grads": grads,
        "rows": [(r.kind, r.status, r.reason) for r in report.rows] if report else [],
        "fallbacks": [str(w.message) for w in caught if "own forward" in str(w.message)],
        "ran": {k: v["calls"] for k, v in torchgraft.stats().items() if v["calls"]},
    }


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        out.put((rank, {scenario: _train(scenario, rank) for scenario in SCENARIOS}))
        # Both ranks are done talking before either tears gloo down (a rank destroying the
        # group while the other still used it aborted a worker under load). Not on failure:
        # a rank that raised must not wait for one that may never come.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, dict[str, Any]]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(WORLD))
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    return results


def _assert_trains_like(run: dict[str, Any], stock: dict[str, Any]) -> None:
    for a, b in zip(run["losses"], stock["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (run["losses"], stock["losses"])
    assert run["grads"].keys() == stock["grads"].keys()
    for name, values in stock["grads"].items():
        g, got = torch.tensor(values), torch.tensor(run["grads"][name])
        assert float((got - g).norm() / g.norm()) < 1e-4, name


@pytest.mark.parametrize(
    ("scenario", "stock"),
    [
        ("fsdp2, adopt before", "fsdp2"),
        ("fsdp2 + gradient checkpointing, adopt before", "fsdp2 + gradient checkpointing"),
        ("fsdp2 + regional compile, adopt before", "fsdp2 + regional compile"),
        ("ddp + checkpoint_wrapper, adopt before", "ddp + checkpoint_wrapper"),
    ],
)
def test_adopted_before_wrapping_every_layer_runs_grafted_and_trains_like_stock(
    runs, scenario: str, stock: str
) -> None:
    for rank, result in runs.items():
        run = result[scenario]
        assert run["rows"] and all(status == "adopted" for _, status, _ in run["rows"]), run
        assert run["fallbacks"] == [], run["fallbacks"]
        _assert_trains_like(run, result[stock])
        # The grafts ran in every process: the fused head (no logits) and the RMSNorm kernel.
        assert run["ran"].get("native/torchgraft::linear_cross_entropy/CPU", 0) >= STEPS, rank
        assert run["ran"].get("native/torchgraft::rms_norm/CPU", 0) >= STEPS, rank


def test_adopted_after_fully_shard_says_why_the_layers_it_cannot_probe_are_skipped(runs) -> None:
    for result in runs.values():
        run = result["fsdp2, adopt after"]
        skipped = [(kind, reason) for kind, status, reason in run["rows"] if status == "skipped"]
        adopted = [kind for kind, status, _ in run["rows"] if status == "adopted"]
        assert skipped and adopted, run["rows"]
        assert all("call adopt() before fully_shard" in reason for _, reason in skipped), skipped
        assert run["fallbacks"] == []
        _assert_trains_like(run, result["fsdp2"])


def test_ranks_end_with_the_same_gradients(runs) -> None:
    first, *others = runs.values()
    for result in others:
        for scenario in SCENARIOS:
            assert result[scenario]["grads"] == first[scenario]["grads"], scenario
