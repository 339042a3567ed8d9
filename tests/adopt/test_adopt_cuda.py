"""torchgraft.adopt on the GPU: tiny transformers models in bfloat16 and under autocast, the CUDA
grafts running under the adopted layers, and the kernels package's CUDA mapping."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from adopt_helpers import (
    assert_steps_close,
    batch,
    contract_module,
    instance_forwards,
    tiny_model,
    train_step,
    use_functional,
)
from torchgraft.adopt.probe import TOLERANCE
from torchgraft.adopt.report import ADOPTED

pytestmark = [pytest.mark.default_torch, pytest.mark.cuda]
pytest.importorskip("transformers")


def _cuda_rms_norm_calls(stats: dict[str, dict[str, int]], op: str) -> int:
    return sum(v["calls"] for k, v in stats.items() if k.endswith(f"{op}/CUDA"))


@pytest.mark.parametrize("functional", ["op", "no-op"])
@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2", "qwen3"])
def test_bfloat16_training_step_on_cuda(monkeypatch, family, functional):
    # With torchgraft.functional.rms_norm: one torchgraft::rms_norm kernel each way per norm;
    # without it (a stand-in functional), the F.rms_norm routes with fuse_weight.
    if functional == "no-op":
        use_functional(monkeypatch, contract_module())
    model = tiny_model(family).to("cuda", torch.bfloat16)
    ids, labels = (t.cuda() for t in batch())
    ref = train_step(model, ids, labels)
    report = torchgraft.adopt(model, fuse_weight=functional == "no-op")
    norms = [r for r in report.rows if r.kind == "rms_norm"]
    assert norms and all(r.status == ADOPTED for r in norms), report.table(False)
    with torchgraft.enabled():
        torchgraft.reset_stats()
        step = train_step(model, ids, labels)
        torch.cuda.synchronize()
        stats = torchgraft.stats()
    op = "torchgraft::rms_norm" if functional == "op" else "aten::_fused_rms_norm"
    assert _cuda_rms_norm_calls(stats, op) >= len(norms)
    assert _cuda_rms_norm_calls(stats, op + "_backward") >= len(norms)
    assert_steps_close(step, ref, TOLERANCE[torch.bfloat16])
    adopted = [r for r in report.rows if r.status == ADOPTED]  # norms, MLPs, RoPE, loss
    assert torchgraft.unadopt(model) == len(adopted)
    assert instance_forwards(model) == {}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_autocast_follows_the_model(family):
    # float32 weights, bfloat16 autocast: the norms see float32 activations (the residual
    # stream) and, for q/k norms, bfloat16 ones with a float32 weight; CUDA autocast would run
    # rms_norm in float32, the adopted layers keep the model's dtypes.
    model = tiny_model(family).cuda()
    ids, labels = (t.cuda() for t in batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = train_step(model, ids, labels)
    torchgraft.adopt(model)
    with torchgraft.enabled(), torch.autocast("cuda", dtype=torch.bfloat16):
        step = train_step(model, ids, labels)
    assert_steps_close(step, ref, TOLERANCE[torch.bfloat16])
    torchgraft.unadopt(model)


def test_the_kernels_package_on_cuda():
    pytest.importorskip("kernels")
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, labels = (t.cuda() for t in batch())
    ref = train_step(model, ids, labels)
    rows = [r for r in torchgraft.adopt(model, via="kernels").rows if r.kind == "rms_norm"]
    assert rows and all((r.status, r.via) == (ADOPTED, "kernels") for r in rows)
    with torchgraft.enabled():
        step = train_step(model, ids, labels)
    assert_steps_close(step, ref, TOLERANCE[torch.bfloat16])
    torchgraft.unadopt(model)
