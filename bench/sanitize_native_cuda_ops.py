"""Drive the native CUDA kernels other than RMSNorm's once each, for compute-sanitizer.

softmax and log-softmax (narrow, wide and very wide rows: every kernel family, with
``TORCHGRAFT_CUDA_SOFTMAX=always`` so that no call is left to ATen), LayerNorm, Adam and AdamW,
SwiGLU and GeGLU (also with the in-place backward), RoPE (full, partial, grouped-query),
cross-entropy (also in place) and the fused linear cross-entropy, the MoE routing (softmax and
sigmoid group-limited top-k: every forward kernel variant), forward and backward, in the
dtypes the kernels compute. Every result is checked against a float64 reference on the CPU, so a
wrong value fails the run as well as a sanitizer report. With the caching allocator off each
tensor is its own allocation and an access past its end is caught:

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1 TORCHGRAFT_CUDA_SOFTMAX=always
    compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_native_cuda_ops.py

(bench/sanitize_native_cuda.py does the same for RMSNorm.) Name parts to run only those
(``... sanitize_native_cuda_ops.py routing``). Without a GPU it runs on the CPU, which checks the
script itself.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import torchgraft
import torchgraft.functional as tgf
from torchgraft.ops.topk_sigmoid.reference import topk_sigmoid_reference
from torchgraft.ops.topk_softmax.reference import topk_softmax_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALVES = [torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 4e-3}
failures: list[str] = []


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64).to(dtype).to(DEVICE)


def check(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out64, ref64 = out.detach().cpu().double(), ref.detach().cpu().double()
    err = float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))
    if not err <= TOL[dtype] or out.shape != ref.shape:
        failures.append(f"{what}: relative error {err:.2e} (shape {tuple(out.shape)})")


def grads(fn, inputs: list[torch.Tensor], upstream: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return [out, *[x.grad for x in leaves]]


def compare(what: str, fn, ref_fn, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    """fn on the device against ref_fn on float64 CPU copies: output and input gradients."""
    with torch.no_grad():
        probe = fn(*inputs)
    upstream = rand(*probe.shape, dtype=probe.dtype)
    got = grads(fn, inputs, upstream)
    with torchgraft.disabled():  # the reference is PyTorch's own
        want = grads(ref_fn, [x.cpu().double() for x in inputs], upstream.cpu().double())
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        check(f"{what} {'output' if i == 0 else f'grad {i - 1}'}", g, w, dtype)


def softmax_and_layer_norm() -> None:
    for dtype in [torch.float32, *HALVES]:
        for cols in (64, 1000, 4097, 65539, 262144):
            rows = 3 if cols > 10000 else 37
            x = rand(rows, cols, dtype=dtype)
            for name, op in (("softmax", F.softmax), ("log_softmax", F.log_softmax)):
                compare(
                    f"{name} {dtype} {cols}",
                    lambda t, op=op: op(t, -1),
                    lambda t, op=op: op(t, -1),
                    [x],
                    dtype,
                )
        for cols in (96, 1000, 4096, 8192):
            x, w, b = rand(29, cols, dtype=dtype), rand(cols, dtype=dtype), rand(cols, dtype=dtype)
            compare(
                f"layer_norm {dtype} {cols}",
                lambda t, w, b, n=cols: F.layer_norm(t, [n], w, b),
                lambda t, w, b, n=cols: F.layer_norm(t, [n], w, b),
                [x, w, b],
                dtype,
            )


def adam() -> None:
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        for dtype in (torch.float32, torch.bfloat16):
            params = [rand(1000, 17, dtype=dtype), rand(5, dtype=dtype), rand(65537, dtype=dtype)]
            copies = [p.detach().cpu().double() for p in params]
            fused = optimizer(
                [p.requires_grad_() for p in params], lr=1e-2, fused=True, weight_decay=0.1
            )
            ref = optimizer([p.requires_grad_() for p in copies], lr=1e-2, weight_decay=0.1)
            for _ in range(2):
                for p, c in zip(params, copies, strict=True):
                    p.grad = rand(*p.shape, dtype=dtype)
                    c.grad = p.grad.cpu().double()
                fused.step()
                with torchgraft.disabled():
                    ref.step()
            for i, (p, c) in enumerate(zip(params, copies, strict=True)):
                check(f"{optimizer.__name__} {dtype} param {i}", p, c, dtype)


def fused_ops() -> None:
    for dtype in [torch.float32, *HALVES]:
        gate, up = rand(33, 1029, dtype=dtype), rand(33, 1029, dtype=dtype)
        compare(f"swiglu {dtype}", tgf.swiglu, lambda g, u: F.silu(g) * u, [gate, up], dtype)
        compare(f"geglu {dtype}", tgf.geglu, lambda g, u: F.gelu(g) * u, [gate, up], dtype)
        compare(
            f"swiglu in place {dtype}",
            lambda g, u: tgf.swiglu(g * 1, u * 1, inplace_backward=True),
            lambda g, u: F.silu(g) * u,
            [gate, up],
            dtype,
        )
        for heads, kv_heads, dim, rotary in ((8, 8, 128, 128), (8, 2, 64, 64), (4, 4, 80, 32)):
            q, k = rand(2, heads, 37, dim, dtype=dtype), rand(2, kv_heads, 37, dim, dtype=dtype)
            cos, sin = rand(2, 37, rotary, dtype=dtype), rand(2, 37, rotary, dtype=dtype)

            def reference(q, k, cos=cos, sin=sin, r=rotary):
                c, s = cos.cpu().double().unsqueeze(1), sin.cpu().double().unsqueeze(1)

                def rotate(x):
                    x_rot, rest = x[..., :r], x[..., r:]
                    x1, x2 = x_rot.chunk(2, dim=-1)
                    return torch.cat((x_rot * c + torch.cat((-x2, x1), -1) * s, rest), -1)

                return torch.cat([rotate(q), rotate(k)], 1)

            compare(
                f"rope {dtype} {heads}/{kv_heads} d{dim} r{rotary}",
                lambda q, k, cos=cos, sin=sin: torch.cat(tgf.rope(q, k, cos, sin), 1),
                reference,
                [q, k],
                dtype,
            )


def losses() -> None:
    for dtype in [torch.float32, *HALVES]:
        loss_dtype = torch.float32 if dtype == torch.float32 else dtype  # the tolerance's
        cross_entropy(rand(67, 32003, dtype=dtype), loss_dtype)
        linear_cross_entropy(rand(300, 256, dtype=dtype), rand(32003, 256, dtype=dtype) / 16)


def cross_entropy(logits: torch.Tensor, loss_dtype: torch.dtype) -> None:
    target = torch.randint(0, logits.shape[1], (logits.shape[0],), device=DEVICE)
    target[::7] = -100

    def reference(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x, target.cpu())

    def in_place(x: torch.Tensor) -> torch.Tensor:
        return tgf.cross_entropy(x * 1, target, inplace_backward=True)

    name = f"cross_entropy {logits.dtype}"
    compare(name, lambda x: tgf.cross_entropy(x, target), reference, [logits], loss_dtype)
    compare(f"{name} in place", in_place, reference, [logits], loss_dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    target = torch.randint(0, weight.shape[0], (hidden.shape[0],), device=DEVICE)

    def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tgf.linear_cross_entropy(h, w, target, chunk_size=128)

    def reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w), target.cpu())

    compare(
        f"linear_cross_entropy {hidden.dtype}", fused, reference, [hidden, weight], hidden.dtype
    )


def routing() -> None:
    """topk_softmax and topk_sigmoid: rows of 8 to 1000 experts (the register kernels and the
    loop kernels), a correction bias, groups, renormalized and scaled; against the routers'
    expressions in torch's ops."""
    for dtype in [torch.float32, *HALVES]:
        for experts, k, groups, topk_groups in ((8, 2, 4, 2), (64, 8, 8, 4), (256, 8, 8, 4),
                                                (512, 16, 1, 1), (1000, 40, 8, 2)):  # fmt: skip
            logits = rand(37, experts, dtype=dtype)
            bias = rand(experts) * 0.1
            route = (k, groups, topk_groups, True, 2.5)

            def sigmoid(x: torch.Tensor) -> torch.Tensor:
                k, groups, topk_groups, renormalize, scale = route  # noqa: B023
                return tgf.topk_sigmoid(
                    x, k, bias=bias, groups=groups, topk_groups=topk_groups,  # noqa: B023
                    renormalize=renormalize, scale=scale,
                )[0]  # fmt: skip

            def sigmoid_reference(x: torch.Tensor) -> torch.Tensor:
                return topk_sigmoid_reference(x, bias.cpu().double(), *route)[0]  # noqa: B023

            def softmax(x: torch.Tensor) -> torch.Tensor:
                return tgf.topk_softmax(x, k, renormalize=True)[0]  # noqa: B023

            def softmax_reference(x: torch.Tensor) -> torch.Tensor:
                return topk_softmax_reference(x, k, True)[0]  # noqa: B023

            size = f"{dtype} {experts} experts"
            compare(f"topk_sigmoid {size}", sigmoid, sigmoid_reference, [logits], dtype)
            compare(f"topk_softmax {size}", softmax, softmax_reference, [logits], dtype)


def main() -> int:
    if DEVICE.type == "cuda" and os.environ.get("TORCHGRAFT_CUDA_SOFTMAX") != "always":
        print("set TORCHGRAFT_CUDA_SOFTMAX=always so that every softmax call runs torchgraft's")
        return 2
    torchgraft.enable()
    parts = (softmax_and_layer_norm, adam, fused_ops, losses, routing)
    chosen = sys.argv[1:]
    for part in [p for p in parts if not chosen or p.__name__ in chosen]:
        part()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        print(f"{part.__name__}: done", flush=True)
    stats = {k: v["calls"] for k, v in torchgraft.stats().items() if v["calls"]}
    print("graft calls:", stats)
    for line in failures:
        print("FAIL", line)
    print("all results match float64" if not failures else f"{len(failures)} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
