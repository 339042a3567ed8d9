"""The models ``torchgraft bench model`` trains: a size and a family, built from a config.

Nothing is downloaded: a transformers config is filled in from the size's table row, and the
model is built from it with random weights, seeded, directly on the device. Every family of a
kind gets the same shape (hidden, layers, heads, MLP, vocab, tied embeddings; the MoE families
their experts too); the family decides the architecture (Qwen3's q/k norms, Gemma's GeGLU and
``1 + weight`` RMSNorm, OLMoE's full-width q/k norms, ...), with its own defaults for everything
else. Dense families share :data:`SIZES`, the MoE families :data:`MOE_SIZES` (Mixtral its own
:data:`MIXTRAL_SIZES`: a few large experts).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "FAMILIES",
    "MIXTRAL_SIZES",
    "MOE_SIZES",
    "SIZES",
    "Experts",
    "Family",
    "Size",
    "active_parameters",
    "build_config",
    "build_model",
    "make_batches",
    "size_for",
    "transformers_missing",
]


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP: ``count`` experts (each a SwiGLU of the size's ``mlp``), a
    router picking ``per_token`` of them for each token, no shared expert."""

    count: int
    per_token: int


@dataclass(frozen=True)
class Size:
    """A model shape and the batch it trains on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    """The MLP's intermediate size (MoE: each expert's)."""
    vocab: int
    tied: bool
    """Input embedding and LM head share one weight."""
    batch: int
    seq: int
    rounds: int
    """Default timing rounds (``--rounds``)."""
    steps: int
    """Default timed steps per round (``--steps``)."""
    summary: str
    experts: Experts | None = None
    """The MoE layer (the MoE families' sizes); None: a dense MLP."""

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch * self.seq

    def to_json(self) -> dict[str, Any]:
        """The row as a dict."""
        return asdict(self)


SIZES: dict[str, Size] = {
    s.name: s
    for s in (
        # name, hidden, layers, heads, kv heads, MLP, vocab, tied, batch, seq, rounds, steps
        Size("tiny", 64, 2, 4, 2, 176, 256, False, 2, 32, 3, 3, "CPU smoke test (CI): seconds"),
        Size("small", 2048, 8, 16, 8, 5632, 32000, False, 4, 2048, 5, 10, "0.5B parameters"),
        Size("1b", 2048, 16, 32, 8, 8192, 128256, True, 2, 4096, 5, 10, "the Llama-3.2-1B shape"),
        Size(
            "8b",
            4096,
            32,
            32,
            8,
            14336,
            128256,
            False,
            1,
            4096,
            3,
            5,
            "the Llama-3.1-8B shape (sharded: bench/fsdp2_train_step.py)",
        ),
    )
}
"""The dense families' sizes by name (``--size``)."""

MOE_SIZES: dict[str, Size] = {
    s.name: s
    for s in (
        # name, hidden, layers, heads, kv heads, expert MLP, vocab, tied, batch, seq, rounds,
        # steps, summary; experts: count, per token
        Size(
            "tiny", 64, 2, 4, 2, 32, 256, False, 2, 32, 3, 3, "CPU smoke test (CI): seconds",
            experts=Experts(4, 2),
        ),
        Size(
            "small", 2048, 8, 16, 4, 768, 151936, False, 2, 4096, 5, 10,
            "Qwen3-30B-A3B's layers (8 of its 48, 64 of its 128 experts, top-8)",
            experts=Experts(64, 8),
        ),
    )
}  # fmt: skip
"""The Qwen3-MoE and OLMoE sizes by name: many small experts, eight per token at ``small``."""

MIXTRAL_SIZES: dict[str, Size] = {
    "tiny": MOE_SIZES["tiny"],
    # Mixtral routes each token to 2 of 8 large experts. 2 x 3072 = 8 x 768: a token meets as
    # many expert weights (the same expert FLOPs) as in MOE_SIZES' small layer, so the steps
    # cost about the same and compare. Mixtral-8x7B's experts (14336 wide at hidden 4096) would
    # be 7168 wide here: 2.3 times the expert FLOPs. The layer holds half the expert weights of
    # 64 x 768 (less memory) and routes 2 copies of each token instead of 8.
    "small": dataclasses.replace(
        MOE_SIZES["small"],
        mlp=3072,
        experts=Experts(8, 2),
        summary="the MoE small with Mixtral's routing: top-2 of 8 experts of 3072",
    ),
}
"""The Mixtral sizes by name: the MoE shapes with a few large experts."""

EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
"""transformers' experts forwards (``experts_implementation=``, the first its default):
``torch._grouped_mm`` over tokens sorted by expert, one batched matmul over each token's chosen
experts' weights, or a Python loop over the experts hit."""


@dataclass(frozen=True)
class Family:
    """A transformers architecture."""

    name: str
    config_class: str
    """The config class's name in ``transformers``."""
    summary: str
    liger: str | None
    """Liger-Kernel's apply function for it (``liger_kernel.transformers.monkey_patch``), None
    where Liger has none."""
    sizes: Mapping[str, Size] = field(default_factory=lambda: SIZES)
    mlp_field: str = "intermediate_size"
    """The config field that takes the size's ``mlp``."""
    experts_field: str = "num_experts"
    """The config field that takes the number of routed experts."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """Config fields set beyond the shape."""
    size_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Config fields set for one size only, by size name (over ``overrides``)."""

    @property
    def moe(self) -> bool:
        """Whether its MLPs are mixtures of experts."""
        return any(s.experts is not None for s in self.sizes.values())


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM: RMSNorm, SwiGLU, RoPE, GQA",
            "apply_liger_kernel_to_llama",
        ),
        Family(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM: Llama plus RMSNorm on q and k",
            "apply_liger_kernel_to_qwen3",
        ),
        Family(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM: Llama with sliding-window attention (window 4096: at these "
            "sizes, the whole sequence)",
            "apply_liger_kernel_to_mistral",
        ),
        Family(
            "gemma",
            "GemmaConfig",
            "GemmaForCausalLM: GeGLU, (1 + weight) RMSNorm",
            "apply_liger_kernel_to_gemma",
        ),
        Family(
            "qwen3moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM: Qwen3 with a top-k MoE MLP, top-k weights renormalized",
            "apply_liger_kernel_to_qwen3_moe",
            sizes=MOE_SIZES,
            # Its intermediate_size is for dense layers (mlp_only_layers), none here.
            mlp_field="moe_intermediate_size",
            overrides={"norm_topk_prob": True},  # as Qwen3-30B-A3B (the config's default: False)
        ),
        Family(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM: Mistral with a top-k MoE MLP, float32 routing weights",
            "apply_liger_kernel_to_mixtral",
            sizes=MIXTRAL_SIZES,
        ),
        Family(
            "olmoe",
            "OlmoeConfig",
            "OlmoeForCausalLM: q/k RMSNorm over all heads, a top-k MoE MLP (not renormalized)",
            None,  # Liger-Kernel has no OLMoE integration
            sizes=MOE_SIZES,
            # Its default end-of-text id (50279) lies outside tiny's vocabulary; nothing here
            # generates text.
            overrides={"eos_token_id": None},
        ),
        Family(
            "glm4moe",
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM: a top-k MoE MLP with DeepSeek-V3's router (sigmoid scores, a "
            "correction bias, the best 4 of 8 groups of experts, weights x 2.5) and a shared "
            "expert, partial RoPE",
            None,  # Liger-Kernel has no GLM-4-MoE integration
            sizes=MOE_SIZES,
            mlp_field="moe_intermediate_size",
            experts_field="n_routed_experts",
            # DeepSeek-V3's routing (GLM-4.5 keeps one group): every layer MoE, one shared expert
            # of the routed experts' width.
            overrides={
                "n_group": 8,
                "topk_group": 4,
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
                "n_shared_experts": 1,
                "first_k_dense_replace": 0,
            },
            size_overrides={"tiny": {"n_group": 2, "topk_group": 1}},  # 4 experts
        ),
    )
}
"""Families by name (``--family``)."""


def size_for(family: Family, name: str) -> Size:
    """``family``'s size ``name``; ValueError naming the sizes it has."""
    size = family.sizes.get(name)
    if size is None:
        raise ValueError(
            f"family {family.name!r} has no size {name!r}; its sizes: {', '.join(family.sizes)}"
        )
    return size


def active_parameters(size: Size, parameters: int) -> int:
    """The parameters one token's forward multiplies with, of ``parameters`` in all: every one of
    a dense model; of an MoE model all but each layer's experts the router did not pick
    (``count - per_token`` SwiGLU experts of ``3 x hidden x mlp`` per layer)."""
    if size.experts is None:
        return parameters
    idle = size.experts.count - size.experts.per_token
    return parameters - size.layers * idle * 3 * size.hidden * size.mlp


def flops_per_step(size: Size, parameters: int) -> float:
    """Training FLOPs of one step (forward and backward): ``6 N`` per token for the matmuls of
    every parameter a token meets (MoE: :func:`active_parameters`), the input embedding excluded
    unless tied to the head (a lookup, not a matmul), plus causal attention's score and value
    matmuls, half of PaLM's ``12 L d S`` per token. The 1b step: 67.3 TFLOP."""
    embedding = 0 if size.tied else size.vocab * size.hidden
    matmuls = 6 * (active_parameters(size, parameters) - embedding) * size.tokens
    attention = 12 * size.layers * size.hidden * size.seq * size.tokens / 2
    return matmuls + attention


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0}
"""Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by the GPU name's model, for MFU."""


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named ``device_name`` (``torch.cuda.get_device_name``), or
    None for a GPU not in :data:`PEAK_BF16_TFLOPS`."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def transformers_missing() -> str | None:
    """Why the models cannot be built here (transformers missing), or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    return None


def build_config(size: Size, family: Family, experts_implementation: str | None = None) -> Any:
    """The family's transformers config with the size's shape (no network). An MoE size's config
    puts the router logits in the output, so that the loss includes the load-balancing loss, and
    runs the experts with ``experts_implementation`` (None: transformers' default,
    ``grouped_mm``)."""
    import transformers

    fields: dict[str, Any] = {
        "hidden_size": size.hidden,
        family.mlp_field: size.mlp,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "vocab_size": size.vocab,
        "max_position_embeddings": max(size.seq, 128),
        "tie_word_embeddings": size.tied,
        "use_cache": False,
    }
    if size.experts is not None:
        fields |= {
            family.experts_field: size.experts.count,
            "num_experts_per_tok": size.experts.per_token,
            "output_router_logits": True,
            "experts_implementation": experts_implementation or EXPERTS_IMPLEMENTATIONS[0],
        }
    config_class = getattr(transformers, family.config_class)
    overrides = {**family.overrides, **family.size_overrides.get(size.name, {})}
    return config_class(**fields, **overrides)


def build_model(config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A causal LM from ``config`` with random weights drawn from ``seed``, on ``device``, in
    training mode, SDPA attention. The same arguments build the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def make_batches(size: Size, count: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """``count`` batches of random token ids (batch x seq), the same for the same seed; each is
    its own labels (the model shifts them)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator).to(device)
        for _ in range(count)
    ]
