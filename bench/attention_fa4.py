"""FA4 (through torchgraft's SDPA overrides) against SDPA's cuDNN and flash backends on one GPU.

    PYTHONPATH=python python3 bench/attention_fa4.py --out results.json \
        --write-crossover crossover.json [--budget 420] [--quick]

For each problem (head dim 64 and 128, causal and not, GQA and not, sequence 1k-16k at 16k
tokens per batch, bf16) it times ``F.scaled_dot_product_attention`` forward and forward +
backward under ``sdpa_kernel(CUDNN_ATTENTION)``, ``sdpa_kernel(FLASH_ATTENTION)`` and with FA4
replacing the op (cuDNN's where SDPA can pick it, else flash's), medians of
``triton.testing.do_bench`` with inputs that require grad (a training forward). A backward
time is (forward + backward) - forward. FA4's output is checked against the baseline's.

``--write-crossover`` writes the table the FA4 conds read (``crossover.json``): one row per
problem and baseline, FA4's pass counted as winning where it was at least 2% faster.
Problems run most important first (d128 causal GQA...), and no new problem starts after
``--budget`` seconds, so a cut-short run still leaves complete rows. FA4 compiles each new
configuration on first use; ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps the compiled
kernels on disk for later processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchgraft import registry
from torchgraft.bench.harness import versions
from torchgraft.bench.timing import measure
from torchgraft.dsl import cutedsl
from torchgraft.grafts import attention
from torchgraft.grafts.attention import crossover

TOKENS = 16384
SEQS = (1024, 2048, 4096, 8192, 16384)
#: head_dim -> (query heads, kv heads under GQA): hidden 2048, the ratios of issue 15.
HEADS = {128: (16, 8), 64: (32, 8)}
#: FA4 must beat the baseline by this factor to count as winning.
MARGIN = 0.98
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


@dataclass
class Problem:
    head_dim: int
    causal: bool
    gqa: bool
    seq: int
    batch: int
    heads: int
    heads_kv: int
    ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """route -> {"fwd": ms, "fwd_bwd": ms}; missing where the route cannot run."""
    notes: dict[str, str] = field(default_factory=dict)


def problems() -> list[Problem]:
    found = []
    for causal in (True, False):
        for head_dim in (128, 64):
            for gqa in (True, False):
                heads, kv = HEADS[head_dim]
                for seq in SEQS:
                    found.append(
                        Problem(
                            head_dim, causal, gqa, seq, TOKENS // seq, heads, kv if gqa else heads
                        )
                    )
    return found


def inputs(p: Problem) -> tuple[torch.Tensor, ...]:
    def make(h: int) -> torch.Tensor:
        t = torch.randn(p.batch, p.seq, h, p.head_dim, device="cuda", dtype=torch.bfloat16)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = make(p.heads), make(p.heads_kv), make(p.heads_kv)
    grad = torch.randn(p.batch, p.heads, p.seq, p.head_dim, device="cuda", dtype=torch.bfloat16)
    return q, k, v, grad


def attend(q, k, v, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )


def time_route(
    p: Problem, backend: str, tensors, quick: bool
) -> tuple[dict[str, float], torch.Tensor]:
    q, k, v, grad = tensors
    with sdpa_kernel(BACKENDS[backend]):
        out = attend(q, k, v, p.causal)  # raises when SDPA has no such kernel here
        fwd = measure(lambda: attend(q, k, v, p.causal), q.device, quick=quick)
        both = measure(
            lambda: torch.autograd.grad(attend(q, k, v, p.causal), (q, k, v), grad),
            q.device,
            quick=quick,
        )
    return {"fwd": fwd.median_ms, "fwd_bwd": both.median_ms}, out.detach()


def run_problem(p: Problem, quick: bool) -> None:
    tensors = inputs(p)
    outputs = {}
    for backend in ("cudnn", "flash"):
        try:
            p.ms[backend], outputs[backend] = time_route(p, backend, tensors, quick)
        except RuntimeError as error:
            p.notes[backend] = str(error).splitlines()[0][:200]
    baseline = "cudnn" if "cudnn" in outputs else "flash" if "flash" in outputs else None
    if baseline is None:
        return
    attention.register()
    registry.reset_stats()
    try:
        with crossover.override("always"):
            p.ms["fa4"], out = time_route(p, baseline, tensors, quick)
        fired = {k: v["calls"] for k, v in registry.override_stats().items() if v["calls"]}
        if not fired:
            p.notes["fa4"] = "FA4 did not run (its cond declined)"
            del p.ms["fa4"]
            return
        ref = outputs[baseline].double()
        p.notes["fa4_rel_err"] = f"{float((out.double() - ref).norm() / ref.norm()):.2e}"
        p.notes["fa4_via"] = baseline
    except RuntimeError as error:
        p.notes["fa4"] = str(error).splitlines()[0][:200]
    finally:
        attention.deregister()


def crossover_rows(results: list[Problem], arch: str) -> list[dict[str, object]]:
    rows = []
    for p in results:
        fa4 = p.ms.get("fa4")
        for baseline in ("cudnn", "flash"):
            base = p.ms.get(baseline)
            if fa4 is None or base is None:
                continue
            fa4_bwd = fa4["fwd_bwd"] - fa4["fwd"]
            base_bwd = base["fwd_bwd"] - base["fwd"]
            rows.append(
                {
                    "arch": arch,
                    "baseline": baseline,
                    "head_dim": p.head_dim,
                    "causal": p.causal,
                    "gqa": p.gqa,
                    "seq": p.seq,
                    "forward": fa4["fwd"] <= MARGIN * base["fwd"],
                    "backward": fa4_bwd <= MARGIN * base_bwd,
                    "ms": {
                        "fa4_fwd": round(fa4["fwd"], 4),
                        "fa4_bwd": round(fa4_bwd, 4),
                        f"{baseline}_fwd": round(base["fwd"], 4),
                        f"{baseline}_bwd": round(base_bwd, 4),
                    },
                    "shape": f"B{p.batch} S{p.seq} {p.heads}/{p.heads_kv} heads d{p.head_dim}",
                }
            )
    return rows


def table(results: list[Problem]) -> str:
    lines = [
        "| d | causal | heads | B x S | cuDNN fwd / f+b | flash fwd / f+b | FA4 fwd / f+b |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in results:
        cells = {
            route: f"{ms['fwd']:.3f} / {ms['fwd_bwd']:.3f}" if (ms := p.ms.get(route)) else "-"
            for route in ("cudnn", "flash", "fa4")
        }
        lines.append(
            f"| {p.head_dim} | {'yes' if p.causal else 'no'} | {p.heads}/{p.heads_kv} | "
            f"{p.batch}x{p.seq} | {cells['cudnn']} | {cells['flash']} | {cells['fa4']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--write-crossover", type=Path, help="write the FA4 crossover table here")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; no new problem after")
    parser.add_argument("--quick", action="store_true", help="shorter timings (noisier)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    reason = cutedsl.library_unusable_reason("flash-attn-4")
    if reason is not None:
        print(f"FA4 unusable: {reason}", file=sys.stderr)
        return 2
    capability = torch.cuda.get_device_capability()
    arch = f"sm{capability[0]}{capability[1]}"
    start = time.monotonic()
    done: list[Problem] = []
    skipped = 0
    for p in problems():
        if time.monotonic() - start > args.budget:
            skipped += 1
            continue
        t0 = time.monotonic()
        run_problem(p, args.quick)
        done.append(p)
        print(
            f"d{p.head_dim} {'causal' if p.causal else 'full'} {p.heads}/{p.heads_kv} "
            f"B{p.batch} S{p.seq}: {p.ms} {p.notes} ({time.monotonic() - t0:.1f} s)",
            flush=True,
        )
        # Written after every problem: a run cut short still leaves complete rows.
        write(args, done, skipped, arch, start, argv)
    write(args, done, skipped, arch, start, argv)
    print(table(done))
    print(f"{len(done)} problems measured, {skipped} skipped for the budget", flush=True)
    return 0


def write(
    args: argparse.Namespace,
    done: list[Problem],
    skipped: int,
    arch: str,
    start: float,
    argv: list[str] | None,
) -> None:
    """Write the results (and the crossover table) for the problems measured so far."""
    rows = crossover_rows(done, arch)
    command = " ".join(["bench/attention_fa4.py", *(argv if argv is not None else sys.argv[1:])])
    report = {
        "command": command,
        "device": torch.cuda.get_device_name(),
        "arch": arch,
        "versions": versions(),
        "timing": "triton.testing.do_bench medians (torchgraft.bench.timing.measure)",
        "problems": [asdict(p) for p in done],
        "skipped_for_budget": skipped,
        "crossover_rows": rows,
        "seconds": round(time.monotonic() - start, 1),
    }
    args.out.write_text(json.dumps(report, indent=1))
    if args.write_crossover is not None:
        table_data = {
            "description": (
                "Where FA4 beat the SDPA kernel it replaces (see crossover.py): "
                f"bench/attention_fa4.py, bf16, {TOKENS} tokens per batch, FA4 counted as "
                f"faster when at most {MARGIN} x the baseline's time."
            ),
            "command": command,
            "device": report["device"],
            "versions": report["versions"],
            "rows": rows,
        }
        args.write_crossover.write_text(json.dumps(table_data, indent=1))


if __name__ == "__main__":
    sys.exit(main())
