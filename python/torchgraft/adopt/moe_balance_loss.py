"""The MoE routers' load-balancing loss without a host sync: transformers'
``load_balancing_loss_func`` with its expert counts taken by ``scatter_add`` instead of
``torch.bincount``.

transformers' MoE models (Qwen2/3-MoE, OLMoE, Mixtral, GPT-OSS... about 25 families) add the
Switch Transformer loss to a training step's loss when ``output_router_logits`` is on. Per layer it
counts the top-k choices per expert with ``torch.bincount(ids, minlength=num_experts)``, and on
CUDA ``bincount`` reads the largest id back to the host to size its output: one device sync per
layer, which empties the GPU's queue at the end of every forward (and breaks a compiled graph).
The replacement counts into a ``num_experts``-long float32 vector with ``scatter_add_`` (exact:
the counts are integers far below 2**24), which needs no size from the device; everything else is
the function's own formula, op for op. Calls with an attention mask (that branch has no sync) or
without router logits run the model's own function.

Found through the model classes whose forward takes ``output_router_logits`` and calls a
``load_balancing_loss_func`` global of its file; that global is replaced (process-wide while
adopted, as RoPE's function is) where its signature is transformers' and the probe (random router
logits of several layers, float32 and bfloat16, with and without a mask; the loss and its gradient
with respect to every layer's logits) agrees with it.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, global_candidate
from torchgraft.adopt.probe import Case, random_tensor

FUNCTION = "load_balancing_loss_func"
PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


def _replacement(own: Callable[..., object]) -> Callable[..., object]:
    def load_balancing_loss_func(
        gate_logits: tuple[torch.Tensor, ...] | torch.Tensor | None,
        num_experts: int | None = None,
        top_k: int = 2,
        attention_mask: torch.Tensor | None = None,
    ) -> object:
        if attention_mask is not None or not isinstance(gate_logits, tuple) or not gate_logits:
            return own(gate_logits, num_experts, top_k, attention_mask)
        assert num_experts is not None
        device = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
        rows = 0
        for layer in gate_logits:
            weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
            _, chosen = torch.topk(weights, top_k, dim=-1)
            chosen = chosen.reshape(-1)
            ones = torch.ones(chosen.shape, dtype=torch.float32, device=device)
            counts.scatter_add_(0, chosen, ones)  # a fresh buffer no graph records
            probs = probs + weights.float().sum(dim=0)
            rows += weights.shape[0]
        return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts

    load_balancing_loss_func.__qualname__ = (
        f"moe_balance_loss[{getattr(own, '__module__', '')}].{FUNCTION}"
    )
    return load_balancing_loss_func


def _variant(own: Callable[..., object]) -> Variant:
    return Variant("expert counts without a host sync", "aten::scatter_add", _replacement(own))


class MoEBalanceLossAdopter:
    """transformers' MoE load-balancing loss (``load_balancing_loss_func``), sync-free."""

    kind = "moe_balance_loss"
    finds = f"{FUNCTION} of the files of models whose forward takes output_router_logits"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        seen: set[str] = set()
        for module in model.modules():
            pymod = _defining_module(module)
            if pymod is None or pymod.__name__ in seen:
                continue
            seen.add(pymod.__name__)
            c = global_candidate(self.kind, pymod, FUNCTION, _variant, _not_plain)
            c.cases = _cases if c.own is not None else None
            c.run = _run
            yield c


def _defining_module(module: nn.Module) -> types.ModuleType | None:
    """The Python module whose ``load_balancing_loss_func`` ``module``'s forward calls, for a
    forward that takes ``output_router_logits``."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return None
    try:
        if "output_router_logits" not in inspect.signature(forward).parameters:
            return None
    except (TypeError, ValueError):
        return None
    own = inspect.unwrap(forward)
    name = getattr(own, "__module__", None)
    pymod = sys.modules.get(name) if isinstance(name, str) else None
    if pymod is None or not callable(getattr(pymod, FUNCTION, None)):
        return None
    return pymod


def _not_plain(own: Callable[..., object]) -> str:
    try:
        names = tuple(inspect.signature(own).parameters)
    except (TypeError, ValueError):
        return "no signature to check"
    if names != PARAMETERS:
        return f"signature is not ({', '.join(PARAMETERS)})"
    return ""


def _cases() -> list[Case]:
    """Three layers' random router logits (10 tokens, 6 experts, top-2), float32 and bfloat16,
    without a mask and with one that pads two tokens; and no logits at all."""
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    cases = [Case("no router logits", (None, 6, 2, None))]
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for label, attention_mask in (("no mask", None), ("padding mask", mask)):
            logits = tuple(
                random_tensor((10, 6), gen, dtype, cpu, scale=2.0).requires_grad_(True)
                for _ in range(3)
            )
            args = (logits, 6, 2, attention_mask)
            cases.append(Case(f"{name}, {label}", args, leaves=logits))
    return cases


def _run(fn: Callable[..., object], case: Case) -> object:
    return fn(*case.args, **case.kwargs)
