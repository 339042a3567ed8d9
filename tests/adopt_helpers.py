"""Shared pieces of the adoption tests: the functional contract's eager semantics, tiny
transformers models, and a training step that collects what the tests compare."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def contract_module(**overrides: Callable[..., object]) -> types.ModuleType:
    """A stand-in ``torchgraft.functional`` that computes the contract's eager expressions
    (/work/briefs/functional_api.md): it lets the tests drive the MLP, RoPE and loss adopters
    before the fused ops land. ``overrides`` replace (or, with ``None``, remove) ops."""

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
        return F.gelu(gate, approximate=approximate) * up

    def rope(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def cross_entropy(
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        return F.cross_entropy(
            logits.float(),
            target,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )

    def linear_cross_entropy(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        return cross_entropy(F.linear(hidden, weight, bias), target, ignore_index, reduction)

    module = types.ModuleType("torchgraft.functional")
    ops = {
        "swiglu": swiglu,
        "geglu": geglu,
        "rope": rope,
        "cross_entropy": cross_entropy,
        "linear_cross_entropy": linear_cross_entropy,
    }
    ops.update(overrides)
    for name, op in ops.items():
        if op is not None:
            setattr(module, name, op)
    return module


def use_functional(monkeypatch: object, module: types.ModuleType) -> None:
    """Make ``torchgraft.functional`` resolve to ``module`` for one test."""
    monkeypatch.setitem(sys.modules, "torchgraft.functional", module)  # type: ignore[attr-defined]


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2")
"""The transformers families the adoption tests cover."""

RMS_NORM_VARIANT = {
    "llama": "llama-style",
    "mistral": "llama-style",
    "qwen2": "llama-style",
    "qwen3": "llama-style",
    "phi3": "llama-style",
    "gemma": "gemma-style (1 + weight)",
    "gemma2": "gemma-style (1 + weight)",
    "olmo2": "fp32-weight",
}
"""What each family's RMSNorm computes (read from its modeling code, transformers 5.17)."""

VOCAB = 96


def tiny_model(family: str, seed: int = 0, **config_overrides: object) -> nn.Module:
    """A two-layer ``<Family>ForCausalLM`` with random weights, built from a config (no network);
    ``config_overrides`` go to the config (``partial_rotary_factor=0.5``...)."""
    import transformers

    names = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "gemma": "Gemma",
        "gemma2": "Gemma2",
        "phi3": "Phi3",
        "olmo2": "Olmo2",
        "gpt_neox": "GPTNeoX",
    }
    name = names[family]
    config = getattr(transformers, f"{name}Config")(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    # Random norm weights (initialised to ones or zeros) so a wrong variant shows.
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
    return model


@dataclass
class Step:
    """What one forward + backward of a causal LM gives."""

    logits: torch.Tensor | None
    """``None`` where the adopted head fused the loss (no logits in training)."""
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def train_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Step:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone()  # torch.compile's wrapper
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    # The fused head + loss (an adopted model training with labels) computes no logits.
    logits = None if out.logits is None else out.logits.detach()
    return Step(logits, out.loss.detach(), grads)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    return float((out64 - ref64).norm() / ref64.norm())


def assert_steps_close(step: Step, ref: Step, tol: float) -> None:
    if step.logits is not None and ref.logits is not None:
        assert step.logits.dtype == ref.logits.dtype
        assert rel_err(step.logits, ref.logits) <= tol
    assert abs(float(step.loss) - float(ref.loss)) <= tol * abs(float(ref.loss))
    assert step.grads.keys() == ref.grads.keys()
    for name, grad in ref.grads.items():
        assert rel_err(step.grads[name], grad) <= tol, name


def instance_forwards(model: nn.Module) -> dict[str, object]:
    """Every module's own ``forward`` entry (absent for almost all: the class's shows through)."""
    return {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """torchgraft enabled (``on``) or disabled inside the block, restored after. Adopted layers
    run torchgraft's operators only while it is enabled."""
    import torchgraft

    was = torchgraft.is_enabled()
    (torchgraft.enable if on else torchgraft.disable)()
    try:
        yield
    finally:
        (torchgraft.enable if was else torchgraft.disable)()


@contextlib.contextmanager
def enabled_throughout() -> Iterator[None]:
    """For an autouse fixture: the test runs with torchgraft enabled, and ends disabled."""
    import torchgraft

    torchgraft.enable()
    try:
        yield
    finally:
        torchgraft.disable()


class SdpaCalls:
    """A compile backend that records, per SDPA call in the traced graph, whether it got a mask
    and ``is_causal``, then runs the graph as traced."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, object]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: object) -> object:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                self.calls.append((mask is not None, node.kwargs.get("is_causal")))
        return gm


MOE_COMMON = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
}
"""The tiny MoE configs' shared fields (the router, experts and head adoption tests)."""

MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral")

SIGMOID_ROUTING = {
    "n_routed_experts": 8,
    "moe_intermediate_size": 16,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
"""DeepSeek-V3's and GLM-4-MoE's routing in the tiny configs (:func:`tiny_moe_model`)."""


def tiny_moe_model(
    family: str, implementation: str = "grouped_mm", dtype: torch.dtype = torch.float32, **config
) -> nn.Module:
    """A tiny transformers MoE model (``family`` in :data:`MOE_FAMILIES`, ``"gpt_oss"``,
    ``"deepseek_v3"`` or ``"glm4_moe"``) from a config, in train mode, its routers (and the
    sigmoid routers' correction biases) drawn at random (they start at zeros, where every
    expert would tie), and GPT-OSS's expert biases too; ``config`` overrides the config's
    fields."""
    import transformers

    fields = {**MOE_COMMON, **config}
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **fields, moe_intermediate_size=16, num_experts=8, norm_topk_prob=True
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**fields, num_experts=8),
        "mixtral": lambda: transformers.MixtralConfig(**fields, num_local_experts=8),
        # Experts with biases, gate and up interleaved, a clamped SwiGLU of its own.
        "gpt_oss": lambda: transformers.GptOssConfig(
            **fields, num_local_experts=8, head_dim=8, sliding_window=8
        ),
        # Sigmoid routers: 8 experts in 4 groups, 2 kept, a correction bias, a shared expert.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **fields,
            **SIGMOID_ROUTING,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(**fields, **SIGMOID_ROUTING),
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        configs[family](), experts_implementation=implementation, dtype=dtype
    )
    for module in model.modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            torch.nn.init.normal_(module.weight, std=0.5)
            bias = module._buffers.get("e_score_correction_bias")
            if bias is not None:
                with torch.no_grad():
                    bias.normal_(std=0.1)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(module, name, None)
            if isinstance(bias, torch.nn.Parameter):
                with torch.no_grad():
                    bias.normal_(std=0.5)
    return model.train()
