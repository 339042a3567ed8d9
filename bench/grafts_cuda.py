"""The native aten grafts of issue 14 on one CUDA GPU: fused AdamW (and Adam).

Run from the repository root on the GPU machine (about 2 minutes on an H100):

    PYTHONPATH=python python3 bench/grafts_cuda.py

1. Correctness: one step of ``aten::_fused_adamw_`` over the whole tensor list, ATen's kernel
   and torchgraft's native kernel on copies of the same state, compared to the bit.
2. Speed: one optimizer step (``_fused_adamw_`` over every tensor, no AMSGrad, no grad scale)
   of a 1.24B-parameter Llama-shaped model (Llama-3.2-1B shapes: embedding 128256x2048, 16
   layers of q/k/v/o and a 8192-wide MLP, norms) and of 4000 small tensors (1..65536
   elements), float32 and bfloat16 states: ATen's fused kernel, torchgraft's, and
   ``torch.compile`` of the foreach AdamW step (``--skip-compile`` to leave it out). Medians of
   CUDA-event timings; effective bandwidth = bytes read + written (param, grad, exp_avg,
   exp_avg_sq read; param, exp_avg, exp_avg_sq written) / time. Issue 14's target: >= 2.7 TB/s
   and >= 1.5x ATen on the 1.2B list.

Writes $OUT/grafts_cuda.json when OUT is set, else bench/results/grafts_cuda.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

import torchgraft

HIDDEN, INTER, LAYERS, VOCAB, KV = 2048, 8192, 16, 128256, 512


def llama_1b_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama-3.2-1B-like model (tied embedding): ~1.24B parameters."""
    shapes: list[tuple[int, ...]] = [(VOCAB, HIDDEN)]
    for _ in range(LAYERS):
        shapes += [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
        shapes += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]
    shapes.append((HIDDEN,))
    return shapes


def small_shapes(n: int = 4000) -> list[tuple[int, ...]]:
    return [((i * 7919) % 65536 + 1,) for i in range(n)]


def make_state(shapes, dtype):
    def rnd(shape, scale=1.0, positive=False):
        t = torch.randn(shape, device="cuda", dtype=dtype) * scale
        return t.abs_() if positive else t

    return [
        [rnd(s) for s in shapes],
        [rnd(s, 0.01) for s in shapes],
        [rnd(s, 0.001) for s in shapes],
        [rnd(s, 1e-6, True) for s in shapes],
        [],
        [torch.tensor(10.0, device="cuda") for _ in shapes],
    ]


KW = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False)


def fused_step(state) -> None:
    torch._fused_adamw_(*state, maximize=False, **KW)


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_bitwise(shapes, dtype) -> dict:
    state = make_state(shapes, dtype)
    theirs = [[t.clone() for t in lst] for lst in state]
    torchgraft.disable()
    fused_step(theirs)
    del theirs[1]  # grads are not written without a grad scale
    torchgraft.enable()
    fused_step(state)
    torchgraft.disable()
    del state[1]
    torch.cuda.synchronize()
    differ = sum(
        int((a != b).sum())
        for la, lb in zip(state, theirs, strict=True)
        for a, b in zip(la, lb, strict=True)
    )
    return {"elements_differing_from_aten": differ, "bitwise_equal": differ == 0}


def compiled_foreach_step(state):
    params = [torch.nn.Parameter(p) for p in state[0]]
    for p, g in zip(params, state[1], strict=True):
        p.grad = g
    opt = torch.optim.AdamW(
        params,
        lr=KW["lr"],
        betas=(KW["beta1"], KW["beta2"]),
        weight_decay=KW["weight_decay"],
        eps=KW["eps"],
        foreach=True,
    )
    return torch.compile(opt.step)


def bench_list(name, shapes, dtype, reps, with_compile) -> dict:
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    state = make_state(shapes, dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    moved = numel * size * 7  # 4 reads + 3 writes per element
    out: dict = {"list": name, "dtype": str(dtype), "tensors": len(shapes), "numel": numel}
    routes = {}
    torchgraft.disable()
    routes["aten_fused"] = time_ms(lambda: fused_step(state), reps)
    torchgraft.enable()
    routes["torchgraft_native"] = time_ms(lambda: fused_step(state), reps)
    torchgraft.disable()
    if with_compile:
        try:
            step = compiled_foreach_step(state)
            routes["torch_compile_foreach"] = time_ms(step, reps)
        except Exception as e:
            out["torch_compile_error"] = repr(e)[:300]
    out["ms"] = routes
    out["effective_TBps"] = {k: moved / (v * 1e-3) / 1e12 for k, v in routes.items()}
    out["speedup_vs_aten"] = routes["aten_fused"] / routes["torchgraft_native"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native_available": torchgraft.native.available(),
    }
    results["bitwise"] = {
        "llama_1b_f32": check_bitwise(llama_1b_shapes(), torch.float32),
        "small_bf16": check_bitwise(small_shapes(), torch.bfloat16),
    }
    print(json.dumps(results["bitwise"], indent=1), flush=True)
    runs = []
    for name, shapes in [("llama_1b", llama_1b_shapes()), ("4000_small", small_shapes())]:
        for dtype in (torch.float32, torch.bfloat16):
            r = bench_list(name, shapes, dtype, args.reps, not args.skip_compile)
            print(json.dumps(r), flush=True)
            runs.append(r)
            torch.cuda.empty_cache()
    results["adamw"] = runs
    results["stats"] = {k: v for k, v in torchgraft.stats().items() if "adam" in k}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "grafts_cuda.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
