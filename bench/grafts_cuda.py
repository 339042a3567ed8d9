"""The native aten grafts of issue 14 on one CUDA GPU: fused AdamW (and Adam), softmax and
log-softmax, LayerNorm.

Run from the repository root on the GPU machine (under 4 minutes on an H100; ``--only`` picks
sections, ``--skip-compile`` leaves torch.compile out):

    PYTHONPATH=python python3 bench/grafts_cuda.py
    PYTHONPATH=python python3 bench/grafts_cuda.py --only softmax,layer_norm

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

3. Softmax and log-softmax over the last dim, bfloat16, widths 1k..256k at 128M elements per
   tensor: the forward op (``aten::_softmax`` / ``_log_softmax``) and its backward
   (``_softmax_backward_data`` / ``_log_softmax_backward_data``) by ATen, torchgraft's native
   kernels on every call (``TORCHGRAFT_CUDA_SOFTMAX=always``), what ``enable()`` does by
   default (the kernels where they were measured faster, ATen's kernel elsewhere) and
   ``torch.compile`` of the same op (static shapes). Medians of CUDA-event timings;
   against a copy of the input (the forward reads and writes one tensor; the backward reads two
   and writes one: its floor is 1.5 copies; torch.compile at 4k and 256k only). Issue 14's
   target: >= 90% of copy bandwidth at widths >= 4k, never slower than ATen.

4. LayerNorm, bfloat16, hidden 4096 and 8192 at 128M elements, weight and bias: the forward op
   (``aten::native_layer_norm``) against a copy of x (target <= 1.05x), the backward
   (``native_layer_norm_backward``, dx, dw and db) against its three-pass floor (1.5 copies:
   read x and dy, write dx; target <= 1.15x) and both against ATen (target >= 1.3x) and
   ``torch.compile`` of the same ops.

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


CALLS_PER_SAMPLE = 10
"""Calls timed back to back per sample: one call between two events would also time the host's
launch latency (tens of microseconds, comparable to these kernels), which back-to-back calls
hide behind the previous call's GPU work."""


def time_ms(fn, reps: int) -> float:
    """Median GPU time of one call over ``reps`` samples of ``CALLS_PER_SAMPLE`` calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS_PER_SAMPLE):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_SAMPLE)
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


SOFTMAX_WIDTHS = [1024, 4096, 16384, 32768, 65536, 131072, 262144]
SOFTMAX_NUMEL = 1 << 27
# torch.compile is timed at these widths only: each compile costs seconds, and the section must
# stay under two minutes.
COMPILE_WIDTHS = (4096, 262144)


def softmax_ops(log: bool):
    a = torch.ops.aten
    if log:
        return a._log_softmax.default, a._log_softmax_backward_data.default
    return a._softmax.default, a._softmax_backward_data.default


def bench_softmax(width: int, log: bool, reps: int, with_compile: bool) -> dict:
    """One width: forward and backward by every route, and the copy they are measured against."""
    dtype = torch.bfloat16
    rows = SOFTMAX_NUMEL // width
    x = torch.randn(rows, width, device="cuda", dtype=dtype) * 3
    dy = torch.randn(rows, width, device="cuda", dtype=dtype)
    fwd, bwd = softmax_ops(log)
    y = fwd(x, -1, False)
    out = torch.empty_like(x)
    copy_ms = time_ms(lambda: out.copy_(x), reps)
    ms: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    torchgraft.disable()
    ms["forward"]["aten"] = time_ms(lambda: fwd(x, -1, False), reps)
    ms["backward"]["aten"] = time_ms(lambda: bwd(dy, y, -1, dtype), reps)
    # The kernels on every call, then what enable() does by default (ATen's kernel where the
    # kernels were not measured faster).
    os.environ["TORCHGRAFT_CUDA_SOFTMAX"] = "always"
    torchgraft.enable()
    ms["forward"]["torchgraft_native"] = time_ms(lambda: fwd(x, -1, False), reps)
    ms["backward"]["torchgraft_native"] = time_ms(lambda: bwd(dy, y, -1, dtype), reps)
    torchgraft.disable()
    del os.environ["TORCHGRAFT_CUDA_SOFTMAX"]
    torchgraft.enable()
    ms["forward"]["torchgraft_default"] = time_ms(lambda: fwd(x, -1, False), reps)
    ms["backward"]["torchgraft_default"] = time_ms(lambda: bwd(dy, y, -1, dtype), reps)
    torchgraft.disable()
    if with_compile and width in COMPILE_WIDTHS:
        try:
            torch._dynamo.reset()  # a fresh cache: no recompile limit across widths and ops
            cf = torch.compile(lambda t: fwd(t, -1, False), dynamic=False)
            cb = torch.compile(lambda g, o: bwd(g, o, -1, dtype), dynamic=False)
            ms["forward"]["torch_compile"] = time_ms(lambda: cf(x), reps)
            ms["backward"]["torch_compile"] = time_ms(lambda: cb(dy, y), reps)
        except Exception as e:
            ms["torch_compile_error"] = repr(e)[:300]  # type: ignore[assignment]
    size = x.element_size() * x.numel()
    floors = {"forward": copy_ms, "backward": 1.5 * copy_ms}
    passes = {"forward": 2, "backward": 3}
    result: dict = {
        "op": "log_softmax" if log else "softmax",
        "dtype": str(dtype),
        "rows": rows,
        "width": width,
        "copy_ms": copy_ms,
        "copy_TBps": 2 * size / (copy_ms * 1e-3) / 1e12,
        "ms": ms,
    }
    for d in ("forward", "backward"):
        routes = {k: v for k, v in ms[d].items()}
        result[f"{d}_TBps"] = {k: passes[d] * size / (v * 1e-3) / 1e12 for k, v in routes.items()}
        result[f"{d}_fraction_of_copy"] = {k: floors[d] / v for k, v in routes.items()}
        result[f"{d}_speedup_vs_aten"] = routes["aten"] / routes["torchgraft_native"]
        result[f"{d}_default_speedup_vs_aten"] = routes["aten"] / routes["torchgraft_default"]
    return result


def run_softmax(reps: int, with_compile: bool) -> list[dict]:
    runs = []
    for log in (False, True):
        for width in SOFTMAX_WIDTHS:
            r = bench_softmax(width, log, reps, with_compile)
            print(json.dumps(r), flush=True)
            runs.append(r)
            torch.cuda.empty_cache()
    return runs


LN_HIDDEN = [4096, 8192]


def bench_layer_norm(hidden: int, reps: int, with_compile: bool) -> dict:
    """One hidden size: forward and backward by every route, and the copy they are measured
    against."""
    dtype = torch.bfloat16
    rows = SOFTMAX_NUMEL // hidden
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    dy = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    b = torch.randn(hidden, device="cuda", dtype=dtype)
    a = torch.ops.aten
    _, mean, rstd = a.native_layer_norm.default(x, [hidden], w, b, 1e-5)

    def fwd():
        return a.native_layer_norm.default(x, [hidden], w, b, 1e-5)

    def bwd():
        return a.native_layer_norm_backward.default(dy, x, [hidden], mean, rstd, w, b, [True] * 3)

    out = torch.empty_like(x)
    copy_ms = time_ms(lambda: out.copy_(x), reps)
    ms: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    torchgraft.disable()
    ms["forward"]["aten"] = time_ms(fwd, reps)
    ms["backward"]["aten"] = time_ms(bwd, reps)
    torchgraft.enable()
    ms["forward"]["torchgraft_native"] = time_ms(fwd, reps)
    ms["backward"]["torchgraft_native"] = time_ms(bwd, reps)
    torchgraft.disable()
    if with_compile:
        try:
            torch._dynamo.reset()
            cf = torch.compile(fwd, dynamic=False)
            cb = torch.compile(bwd, dynamic=False)
            ms["forward"]["torch_compile"] = time_ms(cf, reps)
            ms["backward"]["torch_compile"] = time_ms(cb, reps)
        except Exception as e:
            ms["torch_compile_error"] = repr(e)[:300]  # type: ignore[assignment]
    floors = {"forward": copy_ms, "backward": 1.5 * copy_ms}
    result: dict = {
        "op": "layer_norm",
        "dtype": str(dtype),
        "rows": rows,
        "hidden": hidden,
        "copy_ms": copy_ms,
        "ms": ms,
    }
    for d in ("forward", "backward"):
        routes = ms[d]
        result[f"{d}_vs_floor"] = {k: v / floors[d] for k, v in routes.items()}
        result[f"{d}_speedup_vs_aten"] = routes["aten"] / routes["torchgraft_native"]
    return result


def run_layer_norm(reps: int, with_compile: bool) -> list[dict]:
    runs = []
    for hidden in LN_HIDDEN:
        r = bench_layer_norm(hidden, reps, with_compile)
        print(json.dumps(r), flush=True)
        runs.append(r)
        torch.cuda.empty_cache()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument(
        "--only",
        default="adamw,softmax,layer_norm",
        help="comma-separated sections: adamw, softmax, layer_norm",
    )
    args = parser.parse_args()
    sections = set(args.only.split(","))
    unknown = sections - {"adamw", "softmax", "layer_norm"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native_available": torchgraft.native.available(),
    }
    if "adamw" in sections:
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
    if "softmax" in sections:
        results["softmax"] = run_softmax(args.reps, not args.skip_compile)
    if "layer_norm" in sections:
        results["layer_norm"] = run_layer_norm(args.reps, not args.skip_compile)
    results["stats"] = {k: v for k, v in torchgraft.stats().items() if v["calls"]}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "grafts_cuda.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
