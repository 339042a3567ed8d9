"""The MoE experts' grouped GEMMs on CUDA: ``torch._grouped_mm`` (ATen's kernel, what
transformers' ``grouped_mm`` experts call) against quack's CuteDSL varlen GEMM
(``quack.gemm_interface``), at the MoE yardstick's shapes, for the three GEMMs autograd runs
per projection:

  forward      rows (S, K) x weight^T (E, K, N) -> (S, N), groups along S (varlen M)
  grad_input   grad (S, N) x weight (E, N, K)   -> (S, K), groups along S (varlen M)
  grad_weight  rows^T (K, S) x grad (S, N)      -> (E, K, N), groups along S (varlen K)

The weights are laid out as transformers keeps them ((E, N, K), the forward takes a transposed
view), the group sizes come from a top-k of random router logits. For each GEMM and route, in
alternating rounds:

  device_ms  one call captured in a CUDA graph, its replays timed (``timing.measure``)
  wall_ms    50 eager calls back to back, then a synchronisation, per call (shows the host's
             cost where it exceeds the GPU's: the tiny shape's wall time is the host's cost)

quack's kernels run under a few fixed configurations (``CONFIGS``: no autotuning) and each
one's first call, which compiles, is timed. Every route's output is checked against a float32
per-expert reference (relative norm error) before timing.

    PYTHONPATH=python python bench/grouped_mm_cuda.py --out $OUT/grouped_mm
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchgraft.bench import timing
from torchgraft.bench.results import write_rows

# (name, pairs S, experts E, experts per token, hidden, expert MLP): gate_up is S x hidden x
# 2 MLP, down S x MLP x hidden
SHAPES = [
    ("qwen3moe small", 65536, 64, 8, 2048, 768),
    ("mixtral small", 16384, 8, 2, 2048, 3072),
    # Microseconds of GPU work: its wall time per call is the host's cost of a call.
    ("tiny (host cost)", 512, 8, 2, 128, 64),
]
DEVICE = torch.device("cuda")
DEFAULT = "quack 128x192 pp c2x1"  # quack's default on sm90, what the graft runs
DTYPE = torch.bfloat16


def quack_configs() -> dict[str, object]:
    """The sm90 configurations tried: quack's default and a few of its autotuner's."""
    from quack.gemm_config import GemmConfig

    def sm90(tile_m: int, tile_n: int, pingpong: bool, cluster_m: int, cluster_n: int):
        return GemmConfig(
            tile_m=tile_m,
            tile_n=tile_n,
            pingpong=pingpong,
            cluster_m=cluster_m,
            cluster_n=cluster_n,
            is_dynamic_persistent=False,
            device_capacity=9,
        )

    return {
        "128x192 pp c2x1": sm90(128, 192, True, 2, 1),
        "128x128 pp c2x1": sm90(128, 128, True, 2, 1),
        "256x128 coop c2x1": sm90(256, 128, False, 2, 1),
        "256x192 coop c2x1": sm90(256, 192, False, 2, 1),
    }


def group_offsets(pairs: int, experts: int, top_k: int) -> torch.Tensor:
    """Cumulative group sizes (int32, E entries, no leading zero) of a random routing."""
    tokens = pairs // top_k
    ids = torch.randn(tokens, experts, device=DEVICE).topk(top_k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return counts.cumsum(0).to(torch.int32)


def reference(kind: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """float32 per-expert loop of the same product."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    a32, b32 = a.float(), b.float()
    if kind == "grad_weight":
        return torch.stack([a32[:, s:e] @ b32[s:e] for s, e in zip(starts, ends, strict=True)])
    out = torch.empty(a.shape[0], b.shape[-1], device=a.device)
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        out[s:e] = a32[s:e] @ b32[i]
    return out


def operands(kind: str, pairs: int, experts: int, k: int, n: int):
    """(a, b) as autograd hands them to ``torch._grouped_mm`` for this GEMM."""
    weight = torch.randn(experts, n, k, device=DEVICE, dtype=DTYPE) / k**0.5
    rows = torch.randn(pairs, k, device=DEVICE, dtype=DTYPE)
    grad = torch.randn(pairs, n, device=DEVICE, dtype=DTYPE)
    if kind == "forward":
        return rows, weight.transpose(-2, -1)
    if kind == "grad_input":
        return grad, weight
    return rows.t(), grad


def routes(kind: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    """name -> zero-argument call, for ATen and each quack configuration."""
    from quack.gemm_interface import gemm_tuned

    cu = torch.cat([offs.new_zeros(1), offs])
    experts = offs.numel()
    if kind == "grad_weight":
        out = torch.empty(experts, a.shape[0], b.shape[-1], device=DEVICE, dtype=DTYPE)
        varlen = {"cu_seqlens_k": cu}
    else:
        out = torch.empty(a.shape[0], b.shape[-1], device=DEVICE, dtype=DTYPE)
        varlen = {"cu_seqlens_m": cu}
    calls: dict[str, Callable[[], object]] = {
        "aten": lambda: torch._grouped_mm(a, b, offs=offs),
    }
    for name, config in quack_configs().items():

        def call(config=config) -> torch.Tensor:
            gemm_tuned.fn(a, b, out, config=config, **varlen)
            return out

        calls[f"quack {name}"] = call
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, pairs, experts, top_k, hidden, mlp in SHAPES:
        offs = group_offsets(pairs, experts, top_k)
        for proj, k, n in (("gate_up", hidden, 2 * mlp), ("down", mlp, hidden)):
            for kind in ("forward", "grad_input", "grad_weight"):
                a, b = operands(kind, pairs, experts, k, n)
                expected = reference(kind, a, b, offs)
                flop = 2 * pairs * k * n
                row: dict[str, object] = {
                    "shape": name, "projection": proj, "gemm": kind, "pairs": pairs,
                    "experts": experts, "k": k, "n": n, "tflop": flop / 1e12,
                }  # fmt: skip
                calls = {}
                for route, call in routes(kind, a, b, offs).items():
                    start = time.perf_counter()
                    try:
                        got = call()
                        torch.cuda.synchronize()
                    except Exception as error:  # a config quack refuses for this GEMM
                        row[f"{route} error"] = f"{type(error).__name__}: {error}"[:300]
                        continue
                    row[f"{route} first_call_s"] = time.perf_counter() - start
                    err = (got.float() - expected).norm() / expected.norm()
                    row[f"{route} rel_err"] = float(err)
                    if float(err) > 2e-2:
                        row[f"{route} error"] = f"relative error {float(err):.3g}"
                        continue
                    calls[route] = call
                times: dict[str, dict[str, list[float]]] = {
                    r: {"device": [], "wall": []} for r in calls
                }
                for _ in range(args.rounds):
                    for route, call in calls.items():
                        try:
                            device = timing.measure(timing.graphed(call, DEVICE), DEVICE)
                            times[route]["device"].append(device.median_ms)
                        except Exception as error:  # capture refused: time the eager call
                            row[f"{route} graph_error"] = f"{type(error).__name__}"[:100]
                            times[route]["device"].append(timing.measure(call, DEVICE).median_ms)
                        times[route]["wall"].append(timing.back_to_back_ms(call, 50, DEVICE))
                for route in calls:
                    for what in ("device", "wall"):
                        row[f"{route} {what}_ms"] = statistics.median(times[route][what])
                    row[f"{route} tflops"] = flop / 1e9 / row[f"{route} device_ms"]  # type: ignore[operator]
                quack = [r for r in calls if r.startswith("quack")]
                if quack and "aten" in calls:
                    best = min(quack, key=lambda r: row[f"{r} device_ms"])  # type: ignore[arg-type,return-value]
                    row["best quack"] = best
                    row["aten / best quack"] = row["aten device_ms"] / row[f"{best} device_ms"]  # type: ignore[operator]
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        from importlib.metadata import version

        meta["quack-kernels"] = version("quack-kernels")
        meta["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        pass
    lines = [
        f"**Grouped GEMMs on {meta['device']}** (torch {meta['torch']}, {meta['date']}, device ms "
        f"per call, medians of {meta['rounds']} rounds; `bench/grouped_mm_cuda.py`)",
        "",
        "| shape | projection | GEMM | aten ms (TFLOP/s) | best quack ms (TFLOP/s) | config "
        "| aten / quack | wall ms: aten, quack's default |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = r.get("best quack")
        if best is None:
            continue
        lines.append(
            f"| {r['shape']} | {r['projection']} | {r['gemm']} | {r['aten device_ms']:.3f} "
            f"({r['aten tflops']:.0f}) | {r[f'{best} device_ms']:.3f} ({r[f'{best} tflops']:.0f}) "
            f"| {best} | {r['aten / best quack']:.2f}x "
            f"| {r['aten wall_ms']:.3f}, {r[f'{DEFAULT} wall_ms']:.3f} |"
        )
    write_rows(args.out, "grouped_mm_cuda", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
