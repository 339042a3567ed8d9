"""bench/fsdp2_train_step.py as CI runs it: 2 gloo processes on the CPU, the tiny model, stock
against torchgraft and per-layer compile + torchgraft under FSDP2, with activation
checkpointing and float32 gradient reduction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.default_torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "fsdp2_train_step.py"
STEPS = 3


def test_the_smoke_run_trains_every_variant_like_stock_on_both_ranks(tmp_path: Path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    variants = "stock,torchgraft,compile-regional+torchgraft"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--size", "tiny", "--steps", str(STEPS), "--warmup", "1",
        "--variants", variants, "--compile-backend", "aot_eager",
        "--checkpointing", "--reduce-dtype", "fp32", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "fsdp2_tiny_llama_x2.json").read_text())
    assert (tmp_path / "fsdp2_tiny_llama_x2.md").read_text().startswith("# FSDP2 training step")
    assert report["world"] == 2 and report["checkpointing"] and report["reduce_dtype"] == "fp32"
    assert list(report["variants"]) == variants.split(",")
    stock = report["variants"]["stock"]
    assert len(stock["losses"]) == STEPS and "grafts_per_rank" not in stock
    for name in variants.split(",")[1:]:
        run = report["variants"][name]
        for a, b in zip(run["losses"], stock["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (name, run["losses"], stock["losses"])
        ranks = run["grafts_per_rank"]
        assert len(ranks) == 2
        for calls in ranks:  # the grafts ran in both processes, every step
            assert calls.get("native/torchgraft::rms_norm/CPU", 0) >= STEPS, (name, calls)
            assert calls.get("native/torchgraft::linear_cross_entropy/CPU", 0) >= STEPS, name
        rows = run["notes"]["adoption"]["rows"]
        assert rows and all(r["status"] == "adopted" for r in rows), rows
