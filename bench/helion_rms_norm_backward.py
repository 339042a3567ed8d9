"""Helion's RMSNorm backward kernel on the GPU: which config is fast.

    python3 bench/helion_rms_norm_backward.py sweep OUT    # block sizes at 16384 x 4096 bf16
    python3 bench/helion_rms_norm_backward.py shapes OUT   # Helion's default config vs ATen, native

``sweep`` times the shipped config (dynamic rows and static shapes), Helion's default config and
the shipped config with other block sizes; ``shapes`` times Helion's default config against
ATen's and torchgraft's native backward (``aten::_fused_rms_norm_backward`` with torchgraft off
and on) and checks dx and dw against ATen. CUDA-event medians of 20 calls, ms; JSON under OUT.
(The committed bench/results/helion_rms_norm_backward_cuda-h200.json merges the two outputs.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import helion
import torch

import torchgraft
from torchgraft.grafts.rms_norm import helion_configs, helion_kernels

BODY = helion_kernels._BODIES["backward"]


def _ms(fn: Callable[[], object], n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def _problem(rows: int, hidden: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    return torch.randn_like(x), x, w


def _kernel(config: dict[str, Any] | None, static: bool = False) -> helion.Kernel:
    return helion.kernel(
        BODY,
        config=helion.Config.from_json(json.dumps(config)) if config is not None else None,
        static_shapes=static,
        autotune_effort="none",
    )


def sweep() -> dict[str, Any]:
    g, x, w = _problem(16384, 4096)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    args = (g, x, rstd, w)
    shipped = json.loads(helion_configs.choose("backward", torch.bfloat16, 4096) or "{}")
    out: dict[str, Any] = {"shipped": shipped}
    variants: dict[str, tuple[dict[str, Any] | None, bool]] = {
        "shipped, dynamic rows": (shipped, False),
        "shipped, static shapes": (shipped, True),
        "default config, dynamic rows": (None, False),
    }
    for sizes in ([16, 4], [32, 4], [64, 4], [256, 4], [128, 8], [128, 16], [32, 8], [16, 16]):
        variants[f"block_sizes {sizes}, dynamic rows"] = ({**shipped, "block_sizes": sizes}, False)
    for label, (config, static) in variants.items():
        kernel = _kernel(config, static)
        out[label] = _ms(lambda kernel=kernel: kernel(*args))
        print(label, out[label], flush=True)
    return out


def shapes() -> dict[str, Any]:
    default = _kernel(None)
    rows_out = []
    for rows, hidden in ((16384, 4096), (32768, 4096), (4096, 8192), (16384, 8192), (16384, 2048)):
        g, x, w = _problem(rows, hidden)
        _, rstd = torch.ops.aten._fused_rms_norm(x, [hidden], w, 1e-6)

        def aten(g=g, x=x, rstd=rstd, w=w, hidden=hidden) -> object:
            return torch.ops.aten._fused_rms_norm_backward(g, x, [hidden], rstd, w, [True, True])

        row: dict[str, Any] = {"rows": rows, "hidden": hidden}
        torchgraft.disable()
        row["aten_ms"] = _ms(aten)
        torchgraft.enable()
        row["native_ms"] = _ms(aten)
        torchgraft.disable()
        flat = rstd.reshape(rows).float()
        args = (g, x, flat, w)
        row["helion_default_kernel_ms"] = _ms(lambda args=args: default(*args))
        dx, parts = default(*args)
        ref_dx, ref_dw = aten()
        row["dx_rel_err_vs_aten"] = float((dx.float() - ref_dx.float()).norm() / ref_dx.norm())
        row["dw_rel_err_vs_aten"] = float((parts.sum(0) - ref_dw.float()).norm() / ref_dw.norm())
        rows_out.append(row)
        print(row, flush=True)
    return {"rows": rows_out}


def main() -> None:
    which, out_dir = sys.argv[1], sys.argv[2]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "helion": metadata.version("helion"),
        **(sweep() if which == "sweep" else shapes()),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"helion_rms_norm_backward_{which}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
