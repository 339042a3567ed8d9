"""The yardstick's training step under FSDP2 across GPUs: stock vs torchgraft (issue 17).

    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 1b --out bench/results

Every rank builds the same transformers model from a config (``torchgraft.bench.model_zoo``,
random weights from one seed), shards each decoder layer and then the root with
``fully_shard``, and trains with ``AdamW(fused=True)`` on its own batches. The variants run one
after the other in the same processes: ``stock`` (transformers as shipped, torchgraft off), then
``torchgraft`` (``torchgraft.enable()`` in every process, ``torchgraft.adopt(model)`` before
``fully_shard``). Each trains ``--steps`` steps from the same weights and data; the first
``--warmup`` are not timed. Reported: median ms per step (wall clock around the whole step,
synchronized), tokens/s per GPU, peak memory per GPU, the loss of every step (mean over ranks)
and its largest difference from stock's, and the grafts that ran on each rank.

On a machine without GPUs it runs on gloo, in float32 (``--size tiny``): a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchgraft
from torchgraft.bench.model_zoo import FAMILIES, SIZES, build_config, build_model, make_batches


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--steps", type=int, default=20, help="steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=4, help="untimed first steps (default 4)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and Markdown")
    return p.parse_args(argv)


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    size, family = SIZES[args.size], FAMILIES[args.family]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(build_config(size, family), device, dtype, seed=0)
    adopted: dict[str, int] | None = None
    if variant == "torchgraft":
        torchgraft.enable()
        adopted = {}
        for row in torchgraft.adopt(model).adopted:
            key = f"{row.kind}: {row.layer} ({row.route})"
            adopted[key] = adopted.get(key, 0) + 1
        torchgraft.reset_stats()  # count the steps' calls, not adopt's probes
    _shard(model)
    try:
        params = list(model.parameters())
        try:
            optimizer = torch.optim.AdamW(params, lr=args.lr, fused=True)
        except (RuntimeError, ValueError):  # no fused kernel for this device in this torch
            optimizer = torch.optim.AdamW(params, lr=args.lr)
        batches = make_batches(size, args.steps, device, seed=1000 + dist.get_rank())
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        losses, times = [], []
        for batch in batches:
            _sync(device)
            start = time.perf_counter()
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            _sync(device)
            times.append(time.perf_counter() - start)
        timed = times[args.warmup :]
        ms = 1e3 * statistics.median(timed)
        result: dict[str, Any] = {
            "ms_per_step": ms,
            "ms_all": [1e3 * t for t in timed],
            "tokens_per_s_per_gpu": size.tokens / (ms / 1e3),
            "peak_gib": (
                torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            ),
            "losses": losses,
        }
        if variant == "torchgraft":
            grafts = {k: v["calls"] for k, v in torchgraft.stats().items() if v["calls"]}
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, grafts)
            result["grafts_per_rank"] = everyone
            result["adopted"] = adopted
        return result
    finally:
        if variant == "torchgraft":
            torchgraft.unadopt(model)
            torchgraft.disable()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _markdown(report: dict[str, Any]) -> str:
    stock = report["variants"]["stock"]
    lines = [
        f"# FSDP2 training step: {report['size']} {report['family']}, {report['world']} ranks",
        "",
        f"{report['device']}; torch {report['torch']}, transformers {report['transformers']}; "
        f"{report['dtype']}, {report['steps']} steps per variant, median of the last "
        f"{report['steps'] - report['warmup']}.",
        "",
        "| variant | ms/step | speedup | tokens/s per GPU | peak GiB per GPU | max abs dloss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["variants"].items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        dloss = max(abs(a - b) for a, b in zip(r["losses"], stock["losses"], strict=True))
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {stock['ms_per_step'] / r['ms_per_step']:.2f}x"
            f" | {r['tokens_per_s_per_gpu']:,.0f} | {peak} | {dloss:.3g} |"
        )
    grafts = report["variants"]["torchgraft"]["grafts_per_rank"]
    lines += ["", "Adopted layers (torchgraft.adopt before fully_shard):", ""]
    for key, count in report["variants"]["torchgraft"]["adopted"].items():
        lines.append(f"- {key}: {count}")
    lines += ["", "Grafts that ran (calls per rank):", ""]
    for key in sorted(grafts[0]):
        lines.append(f"- `{key}`: " + ", ".join(str(g.get(key, 0)) for g in grafts))
    lines.append("")
    lines.append(f"Command: `{report['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit("--warmup must be at least 0 and less than --steps")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    try:
        variants = {name: _train(name, args, device) for name in ("stock", "torchgraft")}
        if dist.get_rank() != 0:
            return
        import transformers

        report = {
            "size": args.size,
            "family": args.family,
            "world": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device)
            if cuda
            else f"CPU ({platform.machine()}, gloo)",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": "bfloat16" if cuda else "float32",
            "steps": args.steps,
            "warmup": args.warmup,
            "command": "torchrun --nproc-per-node "
            f"{dist.get_world_size()} bench/fsdp2_train_step.py --size {args.size} "
            f"--family {args.family} --steps {args.steps} --warmup {args.warmup}",
            "variants": variants,
        }
        text = _markdown(report)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            stem = f"fsdp2_{args.size}_{args.family}_x{dist.get_world_size()}"
            (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
            (args.out / f"{stem}.md").write_text(text)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
