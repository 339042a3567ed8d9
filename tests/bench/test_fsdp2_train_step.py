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


def test_ddp_trains_torchgraft_like_stock_and_profiles_each_variant(tmp_path: Path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--size", "tiny", "--steps", str(STEPS), "--warmup", "1",
        "--variants", "stock,torchgraft", "--ddp", "--profile", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "ddp_tiny_llama_x2.json").read_text())
    assert report["parallel"] == "ddp"
    text = (tmp_path / "ddp_tiny_llama_x2.md").read_text()
    assert text.startswith("# DDP training step") and "one profiled step" in text
    stock, grafted = report["variants"]["stock"], report["variants"]["torchgraft"]
    for a, b in zip(grafted["losses"], stock["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (grafted["losses"], stock["losses"])
    for calls in grafted["grafts_per_rank"]:
        assert calls.get("native/torchgraft::linear_cross_entropy/CPU", 0) >= STEPS, calls
    for run in (stock, grafted):
        profiles = run["profile_per_rank"]
        assert len(profiles) == 2
        for p in profiles:  # on the CPU there are no GPU kernels: only the wall time is real
            assert p["wall_ms"] > 0 and p["compute_busy_ms"] == 0 and p["nccl_busy_ms"] == 0


def _script() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp2_train_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profiles_interval_arithmetic() -> None:
    script: object = _script()
    merged = script._merged([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (7.0, 8.0)])  # type: ignore[attr-defined]
    assert merged == [(0.0, 3.0), (5.0, 8.0)]
    # [0, 3] and [5, 8] against [2, 6]: 1 + 1 shared.
    assert script._overlap(merged, [(2.0, 6.0)]) == 2.0  # type: ignore[attr-defined]
    assert script._overlap(merged, [(3.0, 5.0)]) == 0.0  # type: ignore[attr-defined]
    kind = script._kind  # type: ignore[attr-defined]
    assert kind("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert kind("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kind("void at::native::(anonymous namespace)::fused_adamw_kernel") == "optimizer"
    assert kind("graft_rms_fwd_rows_bf16_same_v8") == "other"
