"""Mixture-of-experts routers: ``torchgraft.functional.topk_softmax`` in place of the softmax,
``torch.topk`` and renormalization transformers' top-k routers write, and
``torchgraft.functional.topk_sigmoid`` in place of the sigmoid group-limited routing of
DeepSeek-V3's and GLM-4-MoE's.

transformers' routers (``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``MixtralTopKRouter``...)
hold the gate as a ``(experts, hidden)`` ``weight`` and return ``(router_logits, scores,
indices)``: logits ``F.linear(hidden, weight)`` over the flattened tokens, then the ``top_k``
largest of ``softmax(logits)`` computed in float32, renormalized to sum to one where the router
says so. Two families of numerics exist, offered as variants and verified on the probe:

- **norm_topk_prob** (Qwen2/3-MoE, OLMoE): renormalized when ``self.norm_topk_prob``, scores
  cast back to the logits' dtype;
- **always renormalized** (Mixtral): renormalized, scores left in float32.

The sigmoid routers (``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``...) also hold an
``e_score_correction_bias`` buffer, ``num_group``, ``topk_group``, ``norm_topk_prob`` and
``routed_scaling_factor``; they compute float32 logits, ``sigmoid`` scores, the choice by
``scores + bias`` within the best groups, and return the weights in float32. One variant, also
verified on the probe (with a random correction bias).

Found by structure: a module with a 2-D ``weight`` parameter, integer ``top_k`` and
``hidden_dim``, no ``bias`` and a one-input forward; the sigmoid routers are told apart by
their correction bias and group fields. Routers that compute something else fail the probe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, single_input
from torchgraft.adopt.probe import (
    Case,
    random_tensor,
    swapped_buffers,
    swapped_parameters,
    training_mode,
)
from torchgraft.adopt.report import SKIPPED

OP = "torchgraft::topk_softmax"
SIGMOID_OP = "torchgraft::topk_sigmoid"
# The sigmoid routers' fields beyond the softmax routers'.
_SIGMOID_FIELDS = ("num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


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


def _sigmoid_variants(topk_sigmoid: Routing) -> tuple[Variant, ...]:
    def sigmoid_grouped(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = hidden_states.reshape(-1, self.hidden_dim).float()
        logits = F.linear(x, self.weight.float())
        weights, indices = topk_sigmoid(
            logits,
            self.top_k,
            bias=self.e_score_correction_bias,
            groups=self.num_group,
            topk_groups=self.topk_group,
            renormalize=self.norm_topk_prob,
            scale=self.routed_scaling_factor,
        )
        return logits, weights, indices

    sigmoid_grouped.__qualname__ = "moe_router[sigmoid, group-limited].forward"
    name = "sigmoid scores, group-limited top-k, corrected choice"
    return (Variant(name, SIGMOID_OP, sigmoid_grouped),)


class MoERouterAdopter:
    """transformers' top-k MoE routers, found by structure."""

    kind = "moe_router"
    finds = "weight (experts, hidden) + int top_k and hidden_dim, one-input forward"

    def __init__(self) -> None:
        # The variants made for the functional op in use, by op name (remade when it changes).
        self._variants: dict[str, tuple[Callable[..., object], tuple[Variant, ...]]] = {}

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            if id(module) not in ctx.claimed and _is_router(module):
                yield self._candidate(path, module, ctx)

    def _candidate(self, path: str, module: nn.Module, ctx: Context) -> Candidate:
        c = Candidate(self.kind, path, type(module).__name__, module, "forward", "forward")
        sigmoid = _is_sigmoid_router(module)
        name = "topk_sigmoid" if sigmoid else "topk_softmax"
        fn, missing = ctx.functional_op(name)
        why = missing or _not_plain(module)
        if fn is None or why:
            c.status, c.reason = SKIPPED, why
            return c
        made = self._variants.get(name)
        if made is None or made[0] is not fn:
            made = self._variants[name] = (fn, (_sigmoid_variants if sigmoid else _variants)(fn))
        c.own = module.forward
        c.variants = made[1]
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


def _is_sigmoid_router(module: nn.Module) -> bool:
    bias = module._buffers.get("e_score_correction_bias")
    return (
        bias is not None
        and bias.dim() == 1
        and all(hasattr(module, name) for name in _SIGMOID_FIELDS)
    )


def _not_plain(module: nn.Module) -> str:
    if not single_input(module.forward):
        return "forward does not take exactly one input"
    if module.weight.is_meta:
        return "parameters on the meta device: load the weights first"
    return ""


def _cases(module: nn.Module) -> list[Case]:
    """Random tokens and a random gate (the models initialize it to zeros: every expert would
    tie), in float32 and in the module's dtype; a random correction bias where the router has
    one (the models start it at zeros too)."""
    experts, hidden = module.weight.shape
    gen = torch.Generator().manual_seed(0)
    device = module.weight.device
    bias = module._buffers.get("e_score_correction_bias")
    cases = []
    for dtype in dict.fromkeys((torch.float32, module.weight.dtype)):
        x = random_tensor((2, 7, hidden), gen, dtype, device).requires_grad_(True)
        weight = nn.Parameter(random_tensor((experts, hidden), gen, dtype, device))
        buffers = {}
        if bias is not None:
            # Of the size of the scores' spread, so that it moves the choice.
            scale = 0.2
            buffers["e_score_correction_bias"] = random_tensor(
                bias.shape, gen, bias.dtype, device, scale
            )
        cases.append(
            Case(
                str(dtype).removeprefix("torch."),
                (x,),
                leaves=(x, weight),
                params={"weight": weight},
                buffers=buffers,
                training=True,
            )
        )
    return cases


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    """Logits and scores (differentiable), and the experts as float (compared exactly: the
    probe's values are distinct). Each token's (expert, score) pairs are put in expert order:
    the experts consume them as pairs, and the sigmoid routers leave their order unspecified
    (``torch.topk(..., sorted=False)``)."""
    with (
        swapped_parameters(module, case.params),
        swapped_buffers(module, case.buffers),
        training_mode(module, case.training),
    ):
        logits, scores, indices = fn(*case.args, **case.kwargs)  # type: ignore[misc]
    order = indices.argsort(dim=-1)
    scores, indices = scores.gather(-1, order), indices.gather(-1, order)
    return logits, scores, indices.to(scores.dtype)
