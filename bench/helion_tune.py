"""Tune the Helion RMSNorm kernels once on a GPU and print the config table to commit.

    PYTHONPATH=python python3 bench/helion_tune.py [--hidden 2048,4096,8192] [--dtypes bf16,f32]
        [--rows 16384] [--effort quick] [--budget 300] [--out helion_configs.json]

For each (kernel, dtype, hidden) it runs Helion's autotuner on a (rows, hidden) problem and
records the best config, minimized to what differs from Helion's defaults. The committed
table ``python/torchgraft/grafts/rms_norm/helion_configs.json``, with the tuned entries replacing
or joining its own, is printed and written to ``--out`` (copy it there and commit). Problems
start in order until ``--budget`` seconds have passed; a tune takes roughly 40-90 s with
``--effort quick`` on an H100. Each tuned config is checked against the float64 reference
before it is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from torchgraft.bench.harness import versions
from torchgraft.dsl import helion as helion_dsl
from torchgraft.grafts.rms_norm import helion_configs, rms_norm_reference

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def tune(kernel_name: str, dtype: torch.dtype, rows: int, hidden: int, effort: str) -> str:
    """The best config (Helion JSON, minimized) for one kernel and problem."""
    import helion

    from torchgraft.grafts.rms_norm import helion_kernels

    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    body = helion_kernels._BODIES[kernel_name]
    kernel = helion.kernel(body, static_shapes=False, autotune_effort=effort)
    if kernel_name == "forward":
        args: tuple[object, ...] = (x, w, 1e-6)
    else:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        args = (torch.randn_like(x), x, rstd, w)
    config = kernel.autotune(args, force=True)
    bound = kernel.bind(args)
    minimized = config.minimize(bound.config_spec)
    if kernel_name == "forward":  # check the tuned kernel before keeping its config
        y, _ = helion.kernel(body, config=minimized, static_shapes=False)(*args)
        ref, _ = rms_norm_reference(x, [hidden], w, 1e-6)
        err = float((y.double() - ref).norm() / ref.norm())
        if err > (1e-5 if dtype == torch.float32 else 1e-2):
            raise RuntimeError(f"tuned forward config is wrong: rel err {err:.2e}")
    return minimized.to_json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bf16,f32")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--effort", default="quick", choices=("quick", "full"))
    parser.add_argument("--budget", type=float, default=300.0, help="no new tune after (s)")
    parser.add_argument("--out", type=Path, default=Path("helion_configs.json"))
    args = parser.parse_args(argv)
    reason = helion_dsl.runtime.unusable_reason()
    if reason is not None or not torch.cuda.is_available():
        print(f"cannot tune: {reason or 'no CUDA GPU'}", file=sys.stderr)
        return 2
    start = time.monotonic()
    entries: list[dict[str, object]] = []
    skipped: list[str] = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name.strip()]
        for hidden in (int(h) for h in args.hidden.split(",")):
            for kernel_name in ("forward", "backward"):
                label = f"{kernel_name} {name} {args.rows}x{hidden}"
                if time.monotonic() - start > args.budget:
                    skipped.append(label)
                    continue
                t0 = time.monotonic()
                try:
                    config = tune(kernel_name, dtype, args.rows, hidden, args.effort)
                except Exception as error:  # record and go on: one bad tune keeps the rest
                    print(f"{label}: FAILED {type(error).__name__}: {error}", flush=True)
                    continue
                entries.append(
                    {
                        "kernel": kernel_name,
                        "dtypes": helion_configs.dtype_group(dtype),
                        "hidden": hidden,
                        "config": json.loads(config),
                    }
                )
                print(f"{label}: {config} ({time.monotonic() - t0:.0f} s)", flush=True)
                write(args, entries, argv)  # after every tune: a run cut short keeps them
    print(write(args, entries, argv))
    if skipped:
        print(f"not tuned (budget): {', '.join(skipped)}", flush=True)
    return 0


def write(
    args: argparse.Namespace, entries: list[dict[str, object]], argv: list[str] | None
) -> str:
    """Write the committed table with the configs tuned so far replacing or joining its
    entries to ``--out``; returns its text."""
    tuned = {(e["kernel"], e["dtypes"], e["hidden"]) for e in entries}
    committed = json.loads(helion_configs.TABLE_PATH.read_text())["configs"]
    kept = [e for e in committed if (e["kernel"], e["dtypes"], e["hidden"]) not in tuned]
    merged = sorted(kept + entries, key=lambda e: (e["kernel"], e["dtypes"], e["hidden"]))
    table = {
        "description": (
            "Helion configs for the RMSNorm kernels (see helion_configs.py), tuned by "
            f"bench/helion_tune.py with autotune_effort={args.effort!r} at {args.rows} rows."
        ),
        "command": " ".join(
            ["bench/helion_tune.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": torch.cuda.get_device_name(),
        "helion": versions()["helion"],
        "torch": torch.__version__,
        "configs": merged,
    }
    text = json.dumps(table, indent=1)
    args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
