"""The models ``torchgraft bench model`` trains: a size and a family, built from a config.

Nothing is downloaded: a transformers config is filled in from the size's table row, and the
model is built from it with random weights, seeded, directly on the device. Every family gets
the same shape (hidden, layers, heads, MLP, vocab, tied embeddings); the family decides the
architecture (Qwen3's q/k norms, Gemma's GeGLU and ``1 + weight`` RMSNorm, ...), with its own
defaults for everything else.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "FAMILIES",
    "SIZES",
    "Family",
    "Size",
    "build_config",
    "build_model",
    "make_batches",
    "transformers_missing",
]


@dataclass(frozen=True)
class Size:
    """A model shape and the batch it trains on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    """The MLP's intermediate size."""
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
"""Sizes by name (``--size``)."""


@dataclass(frozen=True)
class Family:
    """A transformers architecture."""

    name: str
    config_class: str
    """The config class's name in ``transformers``."""
    summary: str


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", "LlamaForCausalLM: RMSNorm, SwiGLU, RoPE, GQA"),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM: Llama plus RMSNorm on q and k"),
        Family(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM: Llama with sliding-window attention (window 4096: at these "
            "sizes, the whole sequence)",
        ),
        Family("gemma", "GemmaConfig", "GemmaForCausalLM: GeGLU, (1 + weight) RMSNorm"),
    )
}
"""Families by name (``--family``); each name is also transformers' ``model_type``."""


def flops_per_step(size: Size, parameters: int) -> float:
    """Training FLOPs of one step (forward and backward): ``6 N`` per token for the matmuls of
    every parameter the tokens meet, the input embedding excluded unless tied to the head (a
    lookup, not a matmul), plus causal attention's score and value matmuls, half of PaLM's
    ``12 L d S`` per token. The 1b step: 67.3 TFLOP."""
    embedding = 0 if size.tied else size.vocab * size.hidden
    matmuls = 6 * (parameters - embedding) * size.tokens
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


def build_config(size: Size, family: Family) -> Any:
    """The family's transformers config with the size's shape (no network)."""
    import transformers

    config_class = getattr(transformers, family.config_class)
    return config_class(
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        vocab_size=size.vocab,
        max_position_embeddings=max(size.seq, 128),
        tie_word_embeddings=size.tied,
        use_cache=False,
    )


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
