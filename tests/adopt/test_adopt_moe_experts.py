"""The MoE experts adopter: transformers' experts blocks (Qwen3-MoE, OLMoE, Mixtral) run
torchgraft's permutation ops around their grouped GEMMs, train like stock under every one of
transformers' own experts implementations, and fall back where what was verified changes."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchgraft
from adopt_helpers import MOE_FAMILIES, tiny_moe_model
from torchgraft.adopt import AdoptionFallbackWarning

pytestmark = pytest.mark.default_torch

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert out.aux_loss is not None  # the load-balancing loss is part of the loss
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _experts_rows(report: torchgraft.AdoptionReport) -> list:
    return [r for r in report.rows if r.kind == "moe_experts"]


# Each family under one of transformers' implementations, each implementation once.
@pytest.mark.parametrize(
    ("family", "implementation"),
    list(zip(MOE_FAMILIES, ["grouped_mm", "batched_mm", "eager"], strict=True)),
)
def test_experts_are_adopted_and_train_like_stock(family: str, implementation: str) -> None:
    stock, model = tiny_moe_model(family, implementation), tiny_moe_model(family, implementation)
    ids = _ids()
    want_loss, want_grads = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        rows = _experts_rows(report)
        assert len(rows) == 2 and all(r.status == "adopted" for r in rows), rows
        assert all(r.route == "grouped, fused SwiGLU -> torchgraft::moe_permute" for r in rows), (
            rows
        )
        torchgraft.reset_stats()
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
        stats = torchgraft.stats()
        # moe_permute and swiglu_packed: each block's forward, and again in its backward (the
        # permuted and gated rows are made again for the weight gradients, not kept)
        assert stats["native/torchgraft::moe_permute/CPU"]["calls"] == 4
        # moe_unpermute: each block's forward, and moe_permute's backward
        assert stats["native/torchgraft::moe_unpermute/CPU"]["calls"] == 4
        assert stats["native/torchgraft::moe_unpermute_backward/CPU"]["calls"] == 2
        assert stats["native/torchgraft::swiglu_packed/CPU"]["calls"] == 4
    finally:
        torchgraft.unadopt(model)
    assert _rel(loss, want_loss) < 1e-5
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads, strict=True):
        assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_gpt_oss_experts_with_biases_train_like_stock(implementation: str) -> None:
    """GPT-OSS's experts (biases, gate and up interleaved, its clamped SwiGLU): adopted with the
    block's own gating, each slot's expert bias added after each grouped GEMM."""
    stock = tiny_moe_model("gpt_oss", implementation)
    model = tiny_moe_model("gpt_oss", implementation)
    ids = _ids()
    want_loss, want_grads = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        rows = _experts_rows(report)
        assert len(rows) == 2 and all(r.status == "adopted" for r in rows), rows
        assert all(
            r.route == "grouped, the model's gating -> torchgraft::moe_permute" for r in rows
        )
        torchgraft.reset_stats()
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
        assert torchgraft.stats()["native/torchgraft::moe_permute/CPU"]["calls"] == 4
    finally:
        torchgraft.unadopt(model)
    assert _rel(loss, want_loss) < 1e-5
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert any(n.endswith("experts.gate_up_proj_bias") for n in names)
    for name, got, want in zip(names, grads, want_grads, strict=True):
        assert _rel(got, want) < 1e-4, name


def test_bfloat16_experts_match_stock_within_bfloat16() -> None:
    stock, model = (
        tiny_moe_model("qwen3_moe", dtype=torch.bfloat16),
        tiny_moe_model("qwen3_moe", dtype=torch.bfloat16),
    )
    ids = _ids(2)
    want_loss, want_grads = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        assert all(r.status == "adopted" for r in _experts_rows(report))
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
    finally:
        torchgraft.unadopt(model)
    assert _rel(loss, want_loss) < 1e-2
    experts = [n for n, p in model.named_parameters() if p.grad is not None]
    for name, got, want in zip(experts, grads, want_grads, strict=True):
        assert _rel(got, want) < 3e-2, name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_out_of_range_experts_count_as_zero_like_grouped_mm(family: str) -> None:
    """Expert parallelism's sentinels (ids >= num_experts) contribute nothing, forward and
    backward, as in transformers' grouped_mm implementation: to the biases' gradients too."""
    model = tiny_moe_model(family)
    experts = model.model.layers[0].mlp.experts
    params = [p for n, p in experts.named_parameters() if n != "down_proj"]
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 32, generator=gen, requires_grad=True)
    index = torch.randint(0, 8, (10, 2), generator=gen)
    index[::3, 1] = 8  # a sentinel in every third token
    weights = torch.rand(10, 2, generator=gen).requires_grad_(True)
    upstream = torch.randn(10, 32, generator=gen)

    def run() -> list[torch.Tensor]:
        out = experts(hidden, index, weights)
        grads = torch.autograd.grad(out, (hidden, weights, *params), upstream)
        return [out.detach(), *grads]

    want = run()
    report = torchgraft.adopt(model)
    try:
        assert all(r.status == "adopted" for r in _experts_rows(report))
        with torchgraft.enabled():
            got = run()
    finally:
        torchgraft.unadopt(model)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        assert _rel(g, w) < 1e-5


def test_the_blocks_own_gating_and_its_hooks_run_inside_the_replacement() -> None:
    """The replacement calls the block's ``_apply_gate`` (and so its activation module): a
    hook on the activation runs, and a model's own gating (GPT-OSS clamps its SwiGLU) is kept."""

    def clamped(self: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=0.5)) * (up.clamp(-0.5, 0.5) + 1)

    stock, model = tiny_moe_model("qwen3_moe"), tiny_moe_model("qwen3_moe")
    for m in (stock, model):
        for layer in m.model.layers:
            layer.mlp.experts._apply_gate = clamped.__get__(layer.mlp.experts)
    ids = _ids()
    want_loss, want_grads = _step(stock, ids)
    report = torchgraft.adopt(model)
    try:
        assert all(r.status == "adopted" for r in _experts_rows(report))
        calls: list[int] = []
        handle = model.model.layers[0].mlp.experts.act_fn.register_forward_hook(
            lambda *a: calls.append(1)
        )
        torchgraft.reset_stats()
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
        handle.remove()
        assert calls == [1]
        # each block's forward, and again in its backward (the permuted rows are not kept)
        assert torchgraft.stats()["native/torchgraft::moe_permute/CPU"]["calls"] == 4
    finally:
        torchgraft.unadopt(model)
    assert _rel(loss, want_loss) < 1e-5
    for got, want in zip(grads, want_grads, strict=True):
        assert _rel(got, want) < 1e-4


def test_fused_gating_steps_aside_for_a_hook_and_another_activation() -> None:
    """``swiglu_packed`` serves the gating only where it computes what the block's own would
    and bypasses nothing: a hook on the activation sends that block's calls to its own
    ``_apply_gate``; a GELU activation fails the probe's SiLU check and keeps the model's gating."""
    stock, model = tiny_moe_model("qwen3_moe"), tiny_moe_model("qwen3_moe")
    ids = _ids()
    want_loss, want_grads = _step(stock, ids)
    torchgraft.adopt(model)
    try:
        calls: list[int] = []
        experts = model.model.layers[0].mlp.experts
        handle = experts.act_fn.register_forward_hook(lambda *a: calls.append(1))
        torchgraft.reset_stats()
        with torchgraft.enabled():
            loss, grads = _step(model, ids)
        handle.remove()
        assert calls == [1]
        # the other block only: its forward, and again in its backward (the gated rows)
        assert torchgraft.stats()["native/torchgraft::swiglu_packed/CPU"]["calls"] == 2
    finally:
        torchgraft.unadopt(model)
    assert _rel(loss, want_loss) < 1e-5
    for got, want in zip(grads, want_grads, strict=True):
        assert _rel(got, want) < 1e-4
    gelu = tiny_moe_model("qwen3_moe", hidden_act="gelu")
    rows = _experts_rows(torchgraft.adopt(gelu))
    torchgraft.unadopt(gelu)
    assert all(r.status == "adopted" for r in rows), rows
    assert all(r.route.startswith("grouped, the model's gating") for r in rows), rows


def test_another_implementation_chosen_later_runs_the_blocks_own_forward() -> None:
    model = tiny_moe_model("qwen3_moe")
    ids = _ids()
    torchgraft.adopt(model)
    try:
        model.config._experts_implementation = "batched_mm"  # switched after adoption
        torchgraft.reset_stats()
        with torchgraft.enabled(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(input_ids=ids, labels=ids, use_cache=False)
        assert any(
            issubclass(w.category, AdoptionFallbackWarning)
            and "experts implementation is now 'batched_mm'" in str(w.message)
            for w in caught
        )
        assert torchgraft.stats().get("native/torchgraft::moe_permute/CPU", {}).get("calls", 0) == 0
    finally:
        torchgraft.unadopt(model)


def test_blocks_outside_the_plain_layout_are_skipped_with_the_reason() -> None:
    model = tiny_moe_model("qwen3_moe")
    model.model.layers[0].mlp.experts.has_bias = True
    model.config._experts_implementation = "sonicmoe"  # a user's kernel choice is kept
    report = torchgraft.adopt(model)
    try:
        rows = {r.path: r for r in _experts_rows(report)}
        assert rows["model.layers.0.mlp.experts"].status == "skipped"
        assert "biases" in rows["model.layers.0.mlp.experts"].reason
        assert rows["model.layers.1.mlp.experts"].status == "skipped"
        assert "'sonicmoe' chosen" in rows["model.layers.1.mlp.experts"].reason
    finally:
        torchgraft.unadopt(model)


# In the compatibility set: torch 2.11's dynamo could not trace an import in the forward.
@pytest.mark.compat
def test_compiled_adopted_block_has_no_graph_break() -> None:
    """fullgraph compile of an adopted block, forward and backward: the permutation ops trace
    through their fake kernels. bfloat16: transformers' grouped GEMM under torch.compile takes
    torch's kernel only for bfloat16 (its fallback for other dtypes does not trace backward)."""
    model = tiny_moe_model("qwen3_moe", dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(16, 32, generator=gen).bfloat16().requires_grad_(True)
    index = torch.rand(16, 8, generator=gen).argsort(dim=-1)[:, :2]
    weights = torch.rand(16, 2, generator=gen).bfloat16()
    upstream = torch.randn(16, 32, generator=gen).bfloat16()
    torchgraft.adopt(model)
    try:
        with torchgraft.enabled():
            want = experts(hidden, index, weights)
            (want_grad,) = torch.autograd.grad(want, hidden, upstream)
            compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
            got = compiled(hidden, index, weights)
            (got_grad,) = torch.autograd.grad(got, hidden, upstream)
    finally:
        torchgraft.unadopt(model)
        torch._dynamo.reset()
    assert _rel(got, want) < 1e-2
    assert _rel(got_grad, want_grad) < 1e-2


def test_rows_made_again_in_the_backward_keep_autograds_guarantees() -> None:
    """The permuted and gated rows are not kept but made again in the backward: under
    activation checkpointing (another saved-tensor hook) the block keeps them as usual and
    trains like stock, and an input changed in place after the forward fails the backward (as
    autograd fails it for a saved tensor) rather than computing with the changed values. Stock's
    block alone keeps a copy and does not fail; in a model the router saves the same input, and
    stock fails too."""
    from torch.utils.checkpoint import checkpoint

    stock, model = tiny_moe_model("qwen3_moe"), tiny_moe_model("qwen3_moe")
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(10, 32, generator=gen)
    index = torch.rand(10, 8, generator=gen).argsort(dim=-1)[:, :2]
    weights = torch.rand(10, 2, generator=gen)
    upstream = torch.randn(10, 32, generator=gen)

    def run(m: torch.nn.Module, checkpointed: bool) -> list[torch.Tensor]:
        experts = m.model.layers[0].mlp.experts
        x = hidden.clone().requires_grad_(True)
        if checkpointed:
            out = checkpoint(experts, x, index, weights, use_reentrant=False)
        else:
            out = experts(x, index, weights)
        grads = torch.autograd.grad(out, (x, experts.gate_up_proj, experts.down_proj), upstream)
        return [out.detach(), *grads]

    report = torchgraft.adopt(model)
    try:
        assert all(r.status == "adopted" for r in _experts_rows(report))
        for checkpointed in (False, True):
            want = run(stock, checkpointed)
            with torchgraft.enabled():
                got = run(model, checkpointed)
            for g, w in zip(got, want, strict=True):
                assert _rel(g, w) < 1e-5, checkpointed
        experts = model.model.layers[0].mlp.experts
        x = hidden.clone().requires_grad_(True)
        y = x * 1.0
        with torchgraft.enabled():
            out = experts(y, index, weights)
            y.mul_(2.0)  # the block's input changed after the forward
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward(upstream)
    finally:
        torchgraft.unadopt(model)
