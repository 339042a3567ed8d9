"""What the call-time checks of adopted layers cost on the host (torchgraft.adopt.guard).

A tiny Llama (2 layers, hidden size 32, CPU, float32, one thread) is adopted and enabled; then,
in interleaved rounds, the same model runs with its guarded forwards and with the raw
replacements swapped in (what adopted layers ran before the checks existed). Tiny tensors make
this the worst case: the step is all host time. Also the checks alone, per layer kind (timeit,
best of repeats).

    python bench/adopt_guard_cost.py [rounds]   # default 40

Prints medians over the rounds: train step (forward + backward with labels), eval forward, one
RMSNorm call, one gated-MLP call; then microseconds per check.
"""

from __future__ import annotations

import statistics
import sys
import time
import timeit
import types
import warnings
from collections.abc import Callable

import torch

import torchgraft
from torchgraft.adopt import slots
from torchgraft.adopt.guard import GuardedFunction

VOCAB = 96


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
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
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = tiny_llama()
    torchgraft.adopt(model, via="forward")
    torchgraft.enable()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    labels = ids.clone()
    pymod = sys.modules[type(model).__module__]
    guarded = {
        m: vars(m)["forward"]
        for m in model.modules()
        if "forward" in vars(m) and slots.RECORDS in vars(m)
    }
    loss, rope = vars(model)["_loss_function"], pymod.apply_rotary_pos_emb
    assert isinstance(loss, GuardedFunction) and isinstance(rope, GuardedFunction)

    def checked() -> None:
        for m, f in guarded.items():
            vars(m)["forward"] = f
        vars(model)["_loss_function"], pymod.apply_rotary_pos_emb = loss, rope

    def unchecked() -> None:
        for m, f in guarded.items():
            vars(m)["forward"] = types.MethodType(f.__func__.__wrapped__, m)
        vars(model)["_loss_function"] = loss.replacement
        pymod.apply_rotary_pos_emb = rope.replacement

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    norm, mlp = model.model.norm, model.model.layers[0].mlp
    x = torch.randn(2, 10, 32, generator=gen)
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("train step", step, 10),
        ("eval forward", forward, 10),
        ("rms_norm layer call", lambda: norm(x), 200),
        ("gated mlp layer call", lambda: mlp(x), 100),
    ]
    print(f"interleaved A/B, medians of {rounds} rounds (us per call)")
    for name, fn, n in cases:
        for _ in range(10):
            fn()
        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(rounds):
            for setup, key in ((checked, "checked"), (unchecked, "unchecked")):
                setup()
                t = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                times[key].append((time.perf_counter_ns() - t) / n / 1e3)
        checked()
        a, b = (statistics.median(times[k]) for k in ("checked", "unchecked"))
        print(f"  {name:22s} {a:9.1f} checked {b:9.1f} unchecked {a - b:+7.1f} ({a / b - 1:+.1%})")

    def best(fn: Callable[[], object], n: int = 20000) -> float:
        return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6

    def guard_of(m: torch.nn.Module) -> object:
        return vars(m)[slots.RECORDS]["forward"].guard

    kw = {"labels": labels}
    norm_g, mlp_g, head_g = guard_of(norm), guard_of(mlp), guard_of(model)
    active = torchgraft.control.adopted_layers_active
    print("the checks alone (us, best of 7)")
    print(f"  switch                 {best(lambda: active('rms_norm')):.2f}")
    print(f"  rms_norm               {best(lambda: norm_g.why_not(norm, (x,), {})):.2f}")
    print(f"  gated mlp              {best(lambda: mlp_g.why_not(mlp, (x,), {})):.2f}")
    print(f"  head (train, labels)   {best(lambda: head_g.why_not(model, (), kw)):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
