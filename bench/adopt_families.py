"""torchgraft.adopt over many transformers families: each a tiny causal LM from its config (random
weights, no network) on the CPU, float32; logits before adoption vs adopted with the grafts
enabled, and after unadopt (must be bit-identical to before).

    python bench/adopt_families.py [model_type ...]   # default: the families below

Prints one line per family: OK / MISMATCH / ERROR, the relative error, the grafts that ran, the
forwards restored, and what was adopted (grouped). Families whose config does not build with the
small shared sizes print BUILD-FAIL (not an adoption problem). Takes a few minutes.
"""

from __future__ import annotations

import collections
import sys
import warnings

import torch

import torchgraft

FAMILIES = (
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi3 olmo2 "
    "olmo3 flex_olmo afmoe apertus arcee aria_text bitnet diffllama doge ernie4_5 exaone4 "
    "falcon_h1 glm glm4 gpt_oss granite granitemoe helium hunyuan_v1_dense llama4_text minimax "
    "seed_oss smollm3 lfm2 nanochat cohere olmo phi starcoder2"
).split()
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def check(model_type: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES)).eval()
        with torch.no_grad():
            for m in model.modules():  # norms start at ones/zeros: make a wrong variant show
                weight = getattr(m, "weight", None)
                if type(m).__name__.lower().endswith("rmsnorm") and weight is not None:
                    weight.normal_(0.5, 0.3)
            ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
            ref = model(input_ids=ids).logits
    except Exception as e:
        return f"BUILD-FAIL {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    try:
        report = torchgraft.adopt(model)
        with torchgraft.enabled(), torch.no_grad():
            torchgraft.reset_stats()
            out = model(input_ids=ids).logits
            stats = torchgraft.stats()
        restored = torchgraft.unadopt(model)
        with torch.no_grad():
            back = model(input_ids=ids).logits
    except Exception as e:
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    err = float((out - ref).norm() / ref.norm())
    ran = sum(v["calls"] for k, v in stats.items() if "_fused_rms_norm/" in k)
    adopted = collections.Counter(
        f"{r.layer}: {r.status} {r.route or r.reason[:60]}"
        for r in report.rows
        if r.kind == "rms_norm"
    )
    ok = err <= 1e-5 and torch.equal(back, ref)
    return (
        f"{'OK' if ok else 'MISMATCH'} rel_err={err:.1e} grafts={ran} restored={restored} "
        f"{dict(adopted)}"
    )


def main() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    outcomes: collections.Counter[str] = collections.Counter()
    for model_type in sys.argv[1:] or FAMILIES:
        line = check(model_type)
        outcomes[line.split()[0]] += 1
        print(f"{model_type:20s} {line}", flush=True)
    print(dict(outcomes))
    if outcomes["MISMATCH"] or outcomes["ERROR"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
