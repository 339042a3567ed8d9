"""Mixture-of-experts routers: ``torchgraft.functional.topk_softmax`` in place of the softmax,
``torch.topk`` and renormalization transformers' top-k routers write.

transformers' routers (``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``MixtralTopKRouter``...)
hold the gate as a ``(experts, hidden)`` ``weight`` and return ``(router_logits, scores,
indices)``: logits ``F.linear(hidden, weight)`` over the flattened tokens, then the ``top_k``
largest of ``softmax(logits)`` computed in float32, renormalized to sum to one where the router
says so. Two families of numerics exist, offered as variants and verified on the probe:

- **norm_topk_prob** (Qwen2/3-MoE, OLMoE): renormalized when ``self.norm_topk_prob``, scores
  cast back to the logits' dtype;
- **always renormalized** (Mixtral): renormalized, scores left in float32.

Found by structure: a module with a 2-D ``weight`` parameter, integer ``top_k`` and
``hidden_dim``, no ``bias`` and a one-input forward; routers with a correction bias, group
limits or sigmoid scores (DeepSeek-V3 style) compute something else and fail the probe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, single_input
from torchgraft.adopt.probe import Case, random_tensor, swapped_parameters, training_mode
from torchgraft.adopt.report import SKIPPED

OP = "torchgraft::topk_softmax"


Routing = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _variants(topk_softmax: Routing) -> tuple[Variant, ...]:
    def norm_topk_prob(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, indices = topk_softmax(logits, self.top_k, renormalize=self.norm_topk_prob)
        return logits, weights.to(logits.dtype), indices

    def always_renormalized(
        self: nn.Module, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, indices = topk_softmax(logits, self.top_k, renormalize=True)
        return logits, weights, indices

    norm_topk_prob.__qualname__ = "moe_router[norm_topk_prob].forward"
    always_renormalized.__qualname__ = "moe_router[always renormalized].forward"
    return (
        Variant("norm_topk_prob, scores in the logits' dtype", OP, norm_topk_prob),
        Variant("always renormalized, float32 scores", OP, always_renormalized),
    )


class MoERouterAdopter:
    """transformers' top-k MoE routers, found by structure."""

    kind = "moe_router"
    finds = "weight (experts, hidden) + int top_k and hidden_dim, one-input forward"

    def __init__(self) -> None:
        self._variants: tuple[Callable[..., object], tuple[Variant, ...]] | None = None

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            if id(module) not in ctx.claimed and _is_router(module):
                yield self._candidate(path, module, ctx)

    def _candidate(self, path: str, module: nn.Module, ctx: Context) -> Candidate:
        c = Candidate(self.kind, path, type(module).__name__, module, "forward", "forward")
        fn, missing = ctx.functional_op("topk_softmax")
        why = missing or _not_plain(module)
        if fn is None or why:
            c.status, c.reason = SKIPPED, why
            return c
        if self._variants is None or self._variants[0] is not fn:
            self._variants = (fn, _variants(fn))
        c.own = module.forward
        c.variants = self._variants[1]
        c.cases = functools.partial(_cases, module)
        c.run = functools.partial(_run, module)
        c.preference_key = (self.kind, type(module))
        return c


def _is_router(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return (
        weight is not None
        and weight.dim() == 2
        and isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "hidden_dim", None), int)
        and getattr(module, "bias", None) is None
        and next(module.children(), None) is None
    )


def _not_plain(module: nn.Module) -> str:
    if not single_input(module.forward):
        return "forward does not take exactly one input"
    if module.weight.is_meta:
        return "parameters on the meta device: load the weights first"
    return ""


def _cases(module: nn.Module) -> list[Case]:
    """Random tokens and a random gate (the models initialize it to zeros: every expert would
    tie), in float32 and in the module's dtype."""
    experts, hidden = module.weight.shape
    gen = torch.Generator().manual_seed(0)
    device = module.weight.device
    cases = []
    for dtype in dict.fromkeys((torch.float32, module.weight.dtype)):
        x = random_tensor((2, 7, hidden), gen, dtype, device).requires_grad_(True)
        weight = nn.Parameter(random_tensor((experts, hidden), gen, dtype, device))
        cases.append(
            Case(
                str(dtype).removeprefix("torch."),
                (x,),
                leaves=(x, weight),
                params={"weight": weight},
                training=True,
            )
        )
    return cases


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    """Logits and scores (differentiable), and the experts as float (compared exactly: the
    probe's values are distinct)."""
    with swapped_parameters(module, case.params), training_mode(module, case.training):
        logits, scores, indices = fn(*case.args, **case.kwargs)  # type: ignore[misc]
    return logits, scores, indices.to(scores.dtype)
