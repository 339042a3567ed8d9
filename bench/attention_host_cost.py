"""Host and wall time of one SDPA forward + backward at the 1b yardstick's attention shape, in
the layout a transformers model passes (``(B, S, H, D)`` projections transposed to ``(B, H, S,
D)``, 32 query heads over 8 key/value heads, ``enable_gqa``): SDPA's cuDNN kernels against
torchgraft's FA4 route (``enable()`` with flash-attn-4 installed), then a cProfile of the route.

    python3 bench/attention_host_cost.py > bench/results/attention_host_cost_cuda-<gpu>.txt

The autograd engine runs on the calling thread (``set_multithreading_enabled(False)``) so that
the host time and the profile include the backward. Host time: the calls' CPU time without a
synchronization; wall time: with one at the end.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torchgraft

BATCH, TOKENS, HEADS, KV_HEADS, HEAD_DIM = 2, 4096, 32, 8, 64


def _projection(heads: int) -> torch.Tensor:
    t = torch.randn(BATCH, TOKENS, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return t.transpose(1, 2).detach().requires_grad_(True)


def _per_call_us(fn: Callable[[], None], calls: int, wait: bool) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    q, k, v = _projection(HEADS), _projection(KV_HEADS), _projection(KV_HEADS)
    grad = torch.randn(BATCH, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    grad = grad.transpose(1, 2)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)

    torch.autograd.set_multithreading_enabled(False)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for label, on in (("cudnn", False), ("torchgraft", True)):
        torchgraft.enable() if on else torchgraft.disable()
        host = _per_call_us(step, 20, wait=False)
        wall = _per_call_us(step, 20, wait=True)
        print(f"{label:<10} fwd+bwd host {host:7.0f} us   wall {wall:7.0f} us")
    print({k: v for k, v in torchgraft.stats().items() if "attention" in k})
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        step()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
