"""The yardstick's training step under FSDP2 across GPUs, in the variants of ``torchgraft bench
model`` (issues 17 and 35).

    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 1b --out bench/results
    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 8b \
        --variants stock,liger-flce,torchgraft,compile-regional+torchgraft --reduce-dtype fp32
    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 8b --seq 8192 --checkpointing
    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 1b --ddp
    torchrun --nproc-per-node 2 bench/fsdp2_train_step.py --size 8b --profile

Every rank builds the same transformers model from a config (``torchgraft.bench.model_zoo``,
random weights from one seed), applies the variant (``model_variants.VARIANTS``: torchgraft's
``adopt``, Liger's patches, per-layer ``compile``; all before sharding, in torchtitan's order),
shards each decoder layer and then the root with ``fully_shard`` (``--reduce-dtype fp32``: FSDP2's
``MixedPrecisionPolicy`` reduce-scatters gradients in float32), and trains with
``AdamW(fused=True)`` on its own batches. The variants run one after the other in the same
processes, each ``--steps`` steps from the same weights and data; the first ``--warmup`` are not
timed. Reported: median ms per step (wall clock around the whole step, synchronized), tokens/s
per GPU, MFU (``model_zoo.flops_per_step`` over the GPU's dense bf16 peak), peak memory per GPU,
the loss of every step (mean over ranks) and its largest difference from stock's, and the grafts
that ran on each rank. ``--ddp`` replicates the model with DistributedDataParallel instead of
sharding it. ``--profile`` records one more step of each variant under ``torch.profiler`` and
reports, per rank, the GPU time by kind of kernel (GEMM, attention, NCCL, optimizer, the rest),
how much of the step some compute kernel ran, and how much of the communication ran alongside
compute: what a faster kernel can still win, and what it cannot.

On a machine without GPUs it runs on gloo, in float32 (``--size tiny``): a smoke test (CI runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
from torchgraft.bench import model_zoo
from torchgraft.bench.model_variants import VARIANTS, Setting
from torchgraft.bench.model_zoo import (
    FAMILIES,
    SIZES,
    build_config,
    build_model,
    make_batches,
    size_for,
)

DEFAULT_VARIANTS = "stock,torchgraft"


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, from {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS}; "
        "stock always runs, first)",
    )
    p.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (default: the size's)"
    )
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing (transformers' gradient_checkpointing_enable)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("param", "fp32"),
        default="param",
        help="FSDP2's gradient reduce-scatter dtype (default: the parameters')",
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        help="DistributedDataParallel (the model replicated) instead of FSDP2",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step per variant: GPU time by kind of kernel, per rank",
    )
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--steps", type=int, default=20, help="steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=4, help="untimed first steps (default 4)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and Markdown")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    args.variant_names = ["stock", *[n for n in dict.fromkeys(names) if n != "stock"]]
    return args


def _size(args: argparse.Namespace) -> model_zoo.Size:
    size = size_for(FAMILIES[args.family], args.size)  # the MoE families have sizes of their own
    return dataclasses.replace(size, seq=args.seq) if args.seq else size


def _shard(model: torch.nn.Module, reduce_fp32: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_fp32 else None)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    variant = VARIANTS[name]
    setting = Setting(device=device, family=args.family, compile_backend=args.compile_backend)
    why = variant.unavailable(setting)
    if why is not None:
        return {"error": f"not run: {why}"}
    size = _size(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(build_config(size, FAMILIES[args.family]), device, dtype, seed=0)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    prepared = variant.prepare(model, setting)
    torchgraft.reset_stats()  # count the steps' calls, not adopt's probes
    call = prepared.call
    if args.ddp:
        if prepared.call is not model:
            prepared.undo()
            return {"error": "not run: under --ddp the variant must call the model itself"}
        from torch.nn.parallel import DistributedDataParallel

        call = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    else:
        _shard(model, args.reduce_dtype == "fp32")
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

        def step(batch: torch.Tensor, peaks: dict[str, float] | None = None) -> float:
            mark = _peak_marker(device, peaks)
            loss = call(input_ids=batch, labels=batch, use_cache=False).loss
            mark("forward")
            loss.backward()
            mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark("optimizer")
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            return mean.item() / dist.get_world_size()

        with prepared.active():
            for batch in batches:
                _sync(device)
                start = time.perf_counter()
                losses.append(step(batch))
                _sync(device)
                times.append(time.perf_counter() - start)
            cuda = device.type == "cuda"
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            profile = None
            if args.profile:
                peaks: dict[str, float] = {}
                if cuda:
                    peaks["before the step"] = torch.cuda.memory_allocated(device) / 2**30
                    torch.cuda.reset_peak_memory_stats(device)
                step(batches[-1], peaks)
                profile = _profile(lambda: step(batches[-1]), device)
                profile["peak_gib_by_phase"] = peaks
        timed = times[args.warmup :]
        ms = 1e3 * statistics.median(timed)
        result: dict[str, Any] = {
            "ms_per_step": ms,
            "ms_all": [1e3 * t for t in timed],
            "tokens_per_s_per_gpu": size.tokens / (ms / 1e3),
            "peak_gib": peak,
            "losses": losses,
            "notes": prepared.notes,
        }
        if profile is not None:
            profiles: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(profiles, profile)
            result["profile_per_rank"] = profiles
        if variant.grafts:
            grafts = {k: v["calls"] for k, v in torchgraft.stats().items() if v["calls"]}
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, grafts)
            result["grafts_per_rank"] = everyone
        return result
    finally:
        prepared.undo()
        torchgraft.disable()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("optimizer", ("adam",)),
)
"""Kinds of kernel by what their names contain (checked in order; the rest are ``other``)."""


def _kind(name: str) -> str:
    lower = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(m in lower for m in marks):
            return kind
    return "other"


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of time intervals, as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time two disjoint sorted interval lists share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _peak_marker(device: torch.device, peaks: dict[str, float] | None) -> Any:
    """``mark(phase)`` records the peak memory since the last mark under ``phase`` and resets it
    (CUDA, and only when ``peaks`` is given: the timed steps are left alone)."""

    def mark(phase: str) -> None:
        if peaks is not None and device.type == "cuda":
            peaks[phase] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)

    return mark


def _profile(step: Any, device: torch.device) -> dict[str, Any]:
    """One step under torch.profiler: wall time, GPU time by kind of kernel (summed), the time
    some compute kernel ran, the time NCCL ran, and how much of it ran alongside compute."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        _sync(device)
        wall_ms = 1e3 * (time.perf_counter() - start)
    kind = torch.autograd.DeviceType.CUDA
    by_kind: dict[str, float] = {}
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != kind or e.time_range.elapsed_us() <= 0:
            continue
        if getattr(e, "is_user_annotation", False):
            # a range's span on the GPU timeline (``Optimizer.step#AdamW.step``, FSDP's
            # ``FSDP::all_gather``, NCCL's ``nccl:_all_gather_base``), not a kernel
            continue
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        k = _kind(e.name)
        span = (float(e.time_range.start), float(e.time_range.end))
        by_kind[k] = by_kind.get(k, 0.0) + e.time_range.elapsed_us() / 1e3
        (comm if k == "nccl" else compute).append(span)
    compute, comm = _merged(compute), _merged(comm)
    return {
        "wall_ms": wall_ms,
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "compute_busy_ms": sum(b - a for a, b in compute) / 1e3,
        "nccl_busy_ms": sum(b - a for a, b in comm) / 1e3,
        "nccl_alongside_compute_ms": _overlap(compute, comm) / 1e3,
        "top_kernels_ms": [
            (name[:120], _kind(name), ms)
            for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
        ],
    }


def _markdown(report: dict[str, Any]) -> str:
    stock = report["variants"]["stock"]
    lines = [
        f"# {'DDP' if report['parallel'] == 'ddp' else 'FSDP2'} training step: {report['size']} "
        f"{report['family']}, {report['world']} ranks",
        "",
        f"{report['device']}; torch {report['torch']}, transformers {report['transformers']}; "
        f"{report['dtype']}, batch {report['batch']} x {report['seq']} tokens per rank, "
        f"{report['steps']} steps per variant, median of the last "
        f"{report['steps'] - report['warmup']}; activation checkpointing: "
        f"{'on' if report['checkpointing'] else 'off'}; reduce dtype: {report['reduce_dtype']}.",
        "",
        "| variant | ms/step | speedup | tokens/s per GPU | MFU | peak GiB per GPU "
        "| max abs dloss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | |")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        dloss = max(abs(a - b) for a, b in zip(r["losses"], stock["losses"], strict=True))
        lines.append(
            f"| {name} | {r['ms_per_step']:.1f} | {stock['ms_per_step'] / r['ms_per_step']:.2f}x"
            f" | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {peak} | {dloss:.3g} |"
        )
    for name, r in report["variants"].items():
        if "grafts_per_rank" not in r:
            continue
        grafts = r["grafts_per_rank"]
        lines += ["", f"{name}: grafts that ran (calls per rank):", ""]
        for key in sorted(grafts[0]):
            lines.append(f"- `{key}`: " + ", ".join(str(g.get(key, 0)) for g in grafts))
    for name, r in report["variants"].items():
        if "profile_per_rank" not in r:
            continue
        lines += [
            "",
            f"{name}: one profiled step (ms; kernel time summed by kind; compute busy = the "
            "time some non-NCCL kernel ran):",
            "",
            "| rank | wall | compute busy | NCCL busy | NCCL alongside compute | by kind "
            "| peak GiB by phase |",
            "|---|---:|---:|---:|---:|---|---|",
        ]
        for rank, p in enumerate(r["profile_per_rank"]):
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in p["kernel_ms_by_kind"].items())
            peaks = ", ".join(f"{k} {v:.2f}" for k, v in p["peak_gib_by_phase"].items())
            lines.append(
                f"| {rank} | {p['wall_ms']:.1f} | {p['compute_busy_ms']:.1f} | "
                f"{p['nccl_busy_ms']:.1f} | {p['nccl_alongside_compute_ms']:.1f} | {kinds} "
                f"| {peaks or '-'} |"
            )
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
        variants = {}
        for name in args.variant_names:
            variants[name] = _train(name, args, device)
            # FSDP2's modules sit in reference cycles: without a collection the variant's
            # sharded parameters stay on the GPU through the next variant's steps (7.5 GiB per
            # rank at 8B, counted in its peak and its memory before each step).
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        size = _size(args)
        shape = build_model(
            build_config(size, FAMILIES[args.family]), torch.device("meta"), torch.float32, 0
        )
        parameters = sum(p.numel() for p in shape.parameters())
        flops = model_zoo.flops_per_step(size, parameters)
        peak = model_zoo.peak_bf16_tflops(torch.cuda.get_device_name(device)) if cuda else None
        for r in variants.values():
            if peak is not None and "ms_per_step" in r:
                r["mfu"] = flops / (r["ms_per_step"] / 1e3) / (peak * 1e12)
        if dist.get_rank() == 0:
            _report(args, variants, size, parameters, flops, peak, device)
        dist.barrier()  # rank 0 writes the report while the others wait; then all tear down
    finally:
        dist.destroy_process_group()


def _report(
    args: argparse.Namespace,
    variants: dict[str, Any],
    size: model_zoo.Size,
    parameters: int,
    flops: float,
    peak: float | None,
    device: torch.device,
) -> None:
    """The JSON and Markdown of the run (rank 0)."""
    import transformers

    cuda = device.type == "cuda"
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
        "batch": size.batch,
        "seq": size.seq,
        "parameters": parameters,
        "flops_per_step_per_rank": flops,
        "peak_tflops": peak,
        "checkpointing": args.checkpointing,
        "reduce_dtype": args.reduce_dtype,
        "parallel": "ddp" if args.ddp else "fsdp2",
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "command": "torchrun --nproc-per-node "
        f"{dist.get_world_size()} bench/fsdp2_train_step.py --size {args.size} "
        f"--family {args.family} --variants {','.join(args.variant_names)} "
        f"--steps {args.steps} --warmup {args.warmup} --lr {args.lr:g}"
        + (f" --seq {args.seq}" if args.seq else "")
        + (" --checkpointing" if args.checkpointing else "")
        + f" --reduce-dtype {args.reduce_dtype}"
        + (" --ddp" if args.ddp else "")
        + (" --profile" if args.profile else ""),
        "variants": variants,
    }
    text = _markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = (
            f"{'ddp' if args.ddp else 'fsdp2'}_{args.size}_{args.family}_x{dist.get_world_size()}"
        )
        if args.seq:
            stem += f"_seq{args.seq}"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
