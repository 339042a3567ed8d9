"""SwiGLU and RoPE on one CUDA GPU: torchgraft's fused ops against eager PyTorch,
torch.compile, Liger-Kernel (when importable) and the memory floor, in one run.

Run from the repository root on the GPU machine (about 2 minutes on an H100, most of it
torch.compile):

    python bench/fused_elementwise_cuda.py [--skip-compile] [--cpu-dry-run]

- SwiGLU at 8192 x 8192 bf16: forward (no grad) and forward+backward through autograd; the
  backward kernels alone (allocating, and in place over gate/up); extra peak memory of a
  forward+backward beyond its inputs and dy. torchgraft runs twice: default, and with
  ``inplace_backward=True`` on views of the leaves (so that, as Liger does, the gradients land
  in gate's and up's memory). The floor is 3 (forward) and 8 (forward+backward) moves of one
  tensor at the bandwidth of ``torch.add(a, b, out=c)`` (3 moves).
- RoPE at 2 x 4096 tokens, 32 query / 8 key-value heads, head dim 64 and 128, bf16, q and k as
  Llama's attention makes them (transposed views of the projections): forward and
  forward+backward (gradients of the projections). Floor: q and k read and written plus the
  tables read once, at the same bandwidth.
- The layout question: SDPA (causal, forward+backward) with q/k/v in the layout torchgraft and
  eager give RoPE's outputs (strides of the transposed projections) against contiguous ones.

Medians of ``triton.testing.do_bench`` (L2 flushed between calls). Writes
$OUT/fused_elementwise_cuda.json when OUT is set, else bench/results/fused_elementwise_cuda.json.
``--cpu-dry-run`` runs tiny shapes on the CPU with a wall-clock timer (checks the script).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if not any(Path(p, "torchgraft").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchgraft import functional as tgf  # noqa: E402
from torchgraft.bench.fused_common import liger_attr  # noqa: E402
from torchgraft.bench.rope import llama_rope as rope_eager  # noqa: E402
from torchgraft.bench.rope import rope_tables  # noqa: E402
from torchgraft.bench.routes import RouteUnavailable  # noqa: E402
from torchgraft.bench.swiglu import swiglu_eager  # noqa: E402
from torchgraft.bench.timing import extra_peak_bytes  # noqa: E402

Fn = Callable[[], Any]


def log(msg: str) -> None:
    print(msg, flush=True)


def make_timer(device: str) -> Callable[[Fn], float]:
    """Median milliseconds of one call."""
    if device == "cuda":
        import triton.testing

        return lambda fn: float(
            triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        )

    def cpu_timer(fn: Fn) -> float:
        fn()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return cpu_timer


def extra_peak_mib(device: str, fn: Fn) -> float | None:
    """Peak memory allocated during ``fn`` (after one warm-up call) beyond what was allocated
    before it, in MiB (torchgraft bench's measure)."""
    if device != "cuda":
        return None
    fn()
    peak = extra_peak_bytes(fn, torch.device(device))
    return None if peak is None else peak / 2**20


def liger(module: str, name: str) -> Any | None:
    """``liger_kernel.<module>.<name>`` when Liger-Kernel is importable."""
    try:
        return liger_attr(module, name)
    except RouteUnavailable:
        return None


def liger_version() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    return float((out64 - ref64).norm() / ref64.norm())


# ---------------------------------------------------------------------------------- SwiGLU


def bench_swiglu(
    device: str,
    shape: tuple[int, int],
    timer: Callable[[Fn], float],
    compile_: bool,
    per_move_ms: float,
) -> dict[str, Any]:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    g = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    u = torch.randn(shape, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, device=device, dtype=dtype)
    routes: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "eager": swiglu_eager,
        "torchgraft": tgf.swiglu,
    }
    if compile_:
        routes["torch.compile"] = torch.compile(swiglu_eager)
    liger_fn = liger("ops.swiglu", "LigerSiLUMulFunction")
    if liger_fn is not None:
        routes["liger"] = liger_fn.apply
    # Views of the leaves: non-leaf intermediates that share the leaves' memory, so the
    # in-place backward writes the gradients there (what Liger does to its inputs).
    routes["torchgraft_inplace"] = lambda a, b: tgf.swiglu(
        a.view_as(a), b.view_as(b), inplace_backward=True
    )
    # Liger and the in-place route overwrite the inputs with gradients: each route starts from
    # these values.
    g0, u0 = g.detach().clone(), u.detach().clone()

    ref = swiglu_eager(g.detach().double(), u.detach().double())
    out: dict[str, Any] = {"shape": list(shape), "dtype": "bf16", "routes": {}}
    for name, fn in routes.items():
        with torch.no_grad():
            g.copy_(g0)
            u.copy_(u0)
            err = rel_err(fn(g.detach(), u.detach()), ref)

        def forward(fn=fn) -> Any:
            with torch.no_grad():
                return fn(g, u)

        def forward_backward(fn=fn) -> None:
            fn(g, u).backward(dy)
            g.grad = None
            u.grad = None

        result = {
            "rel_err": err,
            "forward_ms": None if name == "torchgraft_inplace" else timer(forward),
            "forward_backward_ms": timer(forward_backward),
            "extra_peak_mib": extra_peak_mib(device, forward_backward),
        }
        out["routes"][name] = result
        log(
            f"  swiglu {name:20s} fwd {result['forward_ms'] or float('nan'):8.3f} ms   "
            f"fwd+bwd {result['forward_backward_ms']:8.3f} ms   extra "
            f"{result['extra_peak_mib'] or float('nan'):7.1f} MiB   err {err:.1e}"
        )
    # The backward kernels alone: 5 moves.
    gd, ud = g.detach().clone(), u.detach().clone()
    out["backward_kernel_ms"] = timer(lambda: torch.ops.torchgraft.swiglu_backward(dy, gd, ud))
    out["backward_kernel_inplace_ms"] = timer(
        lambda: torch.ops.torchgraft.swiglu_backward_(dy, gd, ud)
    )
    out["floor_ms"] = {
        "forward": 3 * per_move_ms,
        "backward": 5 * per_move_ms,
        "forward_backward": 8 * per_move_ms,
    }
    log(
        f"  swiglu backward kernel {out['backward_kernel_ms']:.3f} ms, in place "
        f"{out['backward_kernel_inplace_ms']:.3f} ms; floor fwd {3 * per_move_ms:.3f}, "
        f"bwd {5 * per_move_ms:.3f}, fwd+bwd {8 * per_move_ms:.3f} ms"
    )
    return out


# ------------------------------------------------------------------------------------ RoPE


def bench_rope(
    device: str,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    dim: int,
    timer: Callable[[Fn], float],
    compile_: bool,
    per_byte_ms: float,
) -> dict[str, Any]:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    qp = torch.randn(batch, seq, heads * dim, device=device, dtype=dtype, requires_grad=True)
    kp = torch.randn(batch, seq, kv_heads * dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(batch, seq, dim, dtype, device)

    def views() -> tuple[torch.Tensor, torch.Tensor]:
        q = qp.view(batch, seq, heads, dim).transpose(1, 2)
        k = kp.view(batch, seq, kv_heads, dim).transpose(1, 2)
        return q, k

    q0, k0 = views()
    gq, gk = (torch.randn_like(t) for t in rope_eager(q0, k0, cos, sin))
    routes: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
        "eager": rope_eager,
        "torchgraft": tgf.rope,
    }
    if compile_:
        routes["torch.compile"] = torch.compile(rope_eager)
    liger_rope = liger("transformers.rope", "liger_rotary_pos_emb")
    if liger_rope is not None:
        routes["liger"] = lambda q, k, c, s: tuple(liger_rope(q, k, c, s))[:2]

    ref_q, ref_k = rope_eager(
        q0.detach().double(), k0.detach().double(), cos.double(), sin.double()
    )
    out: dict[str, Any] = {
        "batch": batch,
        "seq": seq,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "dtype": "bf16",
        "routes": {},
    }
    qp0, kp0 = qp.detach().clone(), kp.detach().clone()
    for name, fn in routes.items():
        with torch.no_grad():
            # Liger rotates in place (its timed calls overwrite the projections).
            qp.copy_(qp0)
            kp.copy_(kp0)
            qo, ko = fn(q0.detach().clone(), k0.detach().clone(), cos, sin)
            err = max(rel_err(qo, ref_q), rel_err(ko, ref_k))
            strides = [list(qo.stride()), list(ko.stride())]

        def forward(fn=fn) -> Any:
            with torch.no_grad():
                q, k = views()
                return fn(q, k, cos, sin)

        def forward_backward(fn=fn) -> None:
            q, k = views()
            torch.autograd.backward(fn(q, k, cos, sin), (gq, gk))
            qp.grad = None
            kp.grad = None

        result = {
            "rel_err": err,
            "output_strides": strides,
            "forward_ms": timer(forward),
            "forward_backward_ms": timer(forward_backward),
        }
        out["routes"][name] = result
        log(
            f"  rope d{dim} {name:14s} fwd {result['forward_ms']:8.3f} ms   fwd+bwd "
            f"{result['forward_backward_ms']:8.3f} ms   err {err:.1e}"
        )
    moved = 2 * (qp.numel() + kp.numel()) * 2 + 2 * cos[0].numel() * 2 * batch
    out["floor_ms"] = {"forward": moved * per_byte_ms, "forward_backward": 2 * moved * per_byte_ms}
    log(f"  rope d{dim} floor fwd {moved * per_byte_ms:.3f} ms")
    return out


def bench_sdpa_layouts(
    device: str,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    dim: int,
    timer: Callable[[Fn], float],
) -> dict[str, float]:
    """SDPA forward+backward with RoPE's output layout (transposed projections) and with
    contiguous (B, H, S, D) tensors."""
    dtype = torch.bfloat16

    def tensors(contiguous: bool) -> list[torch.Tensor]:
        out = []
        for h in (heads, kv_heads, kv_heads):
            t = torch.randn(batch, seq, h, dim, device=device, dtype=dtype).transpose(1, 2)
            out.append((t.contiguous() if contiguous else t).requires_grad_())
        return out

    result = {}
    for layout, contiguous in (("rope_output_layout", False), ("contiguous", True)):
        q, k, v = tensors(contiguous)
        dout = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, dout=dout) -> None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(dout)
            q.grad = k.grad = v.grad = None

        result[layout] = timer(step)
    log(
        f"  sdpa d{dim} fwd+bwd: RoPE output layout {result['rope_output_layout']:.3f} ms, "
        f"contiguous {result['contiguous']:.3f} ms"
    )
    return result


# ----------------------------------------------------------------------------------- main


def add_time_ms(device: str, shape: tuple[int, int], timer: Callable[[Fn], float]) -> float:
    """Time of ``torch.add(a, b, out=c)`` in bf16: 3 tensor moves at the memory's bandwidth."""
    a, b, c = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
    return timer(lambda: torch.add(a, b, out=c))


def targets(swiglu: dict[str, Any], ropes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """issue 13's targets, checked."""
    out = []

    def add(what: str, value: float | None, limit: float | None) -> None:
        ok = value is not None and limit is not None and value <= limit
        out.append({"target": what, "value": value, "limit": limit, "pass": ok})
        log(f"  {'PASS' if ok else 'FAIL'} {what}: {value} <= {limit}")

    r = swiglu["routes"]
    tg = r["torchgraft"]
    add("swiglu fwd <= 1.05 x floor", tg["forward_ms"], 1.05 * swiglu["floor_ms"]["forward"])
    best = min(
        r["torchgraft"]["forward_backward_ms"], r["torchgraft_inplace"]["forward_backward_ms"]
    )
    add("swiglu fwd+bwd <= 1.1 x floor", best, 1.1 * swiglu["floor_ms"]["forward_backward"])
    if "liger" in r:
        add("swiglu fwd+bwd <= Liger", best, r["liger"]["forward_backward_ms"])
        add(
            "swiglu (in place) extra memory <= Liger's",
            r["torchgraft_inplace"]["extra_peak_mib"],
            r["liger"]["extra_peak_mib"],
        )
    for rope in ropes:
        rr = rope["routes"]
        d = rope["head_dim"]
        if "torch.compile" in rr:
            add(
                f"rope d{d} fwd <= 1.1 x torch.compile",
                rr["torchgraft"]["forward_ms"],
                1.1 * rr["torch.compile"]["forward_ms"],
            )
        others = [v["forward_backward_ms"] for k, v in rr.items() if k != "torchgraft"]
        add(
            f"rope d{d} fwd+bwd <= 0.5 x best other",
            rr["torchgraft"]["forward_backward_ms"],
            0.5 * min(others),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile routes")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu-dry-run)")
    timer = make_timer(device)
    swiglu_shape = (64, 96) if args.cpu_dry_run else (8192, 8192)
    batch, seq, heads, kv_heads = (2, 16, 4, 2) if args.cpu_dry_run else (2, 4096, 32, 8)
    compile_ = not args.skip_compile

    add_ms = add_time_ms(device, swiglu_shape, timer)
    per_move_ms = add_ms / 3
    per_byte_ms = per_move_ms / (swiglu_shape[0] * swiglu_shape[1] * 2)
    log(
        f"bandwidth: add of {list(swiglu_shape)} bf16 {add_ms:.3f} ms "
        f"({3 * swiglu_shape[0] * swiglu_shape[1] * 2 / add_ms / 1e9:.2f} TB/s)"
    )

    log("SwiGLU")
    swiglu = bench_swiglu(device, swiglu_shape, timer, compile_, per_move_ms)
    log("RoPE")
    ropes, sdpa = [], {}
    for dim in (64, 128):
        ropes.append(
            bench_rope(device, batch, seq, heads, kv_heads, dim, timer, compile_, per_byte_ms)
        )
        sdpa[f"d{dim}"] = bench_sdpa_layouts(device, batch, seq, heads, kv_heads, dim, timer)
    log("Targets")
    checked = targets(swiglu, ropes)

    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "liger_kernel": liger_version(),
        "timer": "triton.testing.do_bench median" if device == "cuda" else "perf_counter",
        "bandwidth_add_ms": add_ms,
        "swiglu": swiglu,
        "rope": ropes,
        "sdpa_layouts": sdpa,
        "targets": checked,
    }
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = (
        "fused_elementwise_cuda_dry_run.json" if args.cpu_dry_run else "fused_elementwise_cuda.json"
    )
    (out_dir / name).write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main()
