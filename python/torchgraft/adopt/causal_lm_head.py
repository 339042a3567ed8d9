"""The causal-LM head and its loss in training: ``lm_head`` + transformers' ``ForCausalLMLoss``,
routed to ``torchgraft.functional.linear_cross_entropy`` so that the logits never exist.

A transformers ``*ForCausalLM`` computes ``logits = lm_head(hidden)`` over every token, then the
loss upcasts them to float32: at 8192 tokens and a 128k vocabulary that is gigabytes of logits,
their float32 copy and their gradient. The replacement forward runs the model's own base model
(``self.model``), then the fused, chunked head + loss on its last hidden state, with
``ForCausalLMLoss``'s semantics (labels shifted left and padded with ``ignore_index`` unless
``shift_labels`` is given; mean over the tokens not ignored, or a sum divided by
``num_items_in_batch``). transformers' MoE models (``output_router_logits``) add their routers'
load-balancing loss as their own forward does, with the ``load_balancing_loss_func`` it calls.

It takes that path only when it changes nothing but the memory: the module is training, labels
are given, every position's logits are asked for (``logits_to_keep=0``) and a dict output is
expected. Then the output's ``logits`` is ``None`` (as Liger-Kernel's fused loss gives in
training); every other call runs the model's own forward unchanged. Found on modules with a
base model (``base_model_prefix``), an ``nn.Linear`` ``lm_head`` without hooks and transformers'
``ForCausalLMLoss``; skipped where the logits are transformed after the head (Gemma 2/3's final
soft-capping) or a MoE forward adds another router loss, and, like every adopter, adopted only
where the probe (the whole model's loss and the head's and embedding's gradients, on a short
random batch; a MoE model's router loss too) agrees with the model's own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt import guard
from torchgraft.adopt.base import Candidate, Context, Variant
from torchgraft.adopt.causal_lm_loss import is_transformers_causal_lm_loss
from torchgraft.adopt.probe import Case, training_mode
from torchgraft.adopt.report import SKIPPED


def _shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``ForCausalLMLoss``'s targets: position ``t`` predicts token ``t + 1``; the last predicts
    nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _takes_fused_path(
    self: nn.Module, labels: object, logits_to_keep: object, kwargs: dict[str, object]
) -> bool:
    """Whether the fused path gives what the model's own forward gives, less the logits."""
    if not (self.training and labels is not None):
        return False
    if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
        return False
    return_dict = kwargs.get("return_dict")
    if return_dict is None:  # the config's, as transformers' forward reads it
        return_dict = getattr(self.config, "return_dict", True)
    return bool(return_dict)


def _base_inputs(
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: object,
    inputs_embeds: torch.Tensor | None,
    use_cache: bool | None,
) -> dict[str, object]:
    """The arguments a ``*ForCausalLM`` forward passes on to its base model by name."""
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "past_key_values": past_key_values,
        "inputs_embeds": inputs_embeds,
        "use_cache": use_cache,
    }


def _head_loss(
    self: nn.Module,
    linear_cross_entropy: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    kwargs: dict[str, object],
) -> torch.Tensor:
    """``ForCausalLMLoss(lm_head(hidden), labels, **kwargs)`` without the logits."""
    ignore_index = int(kwargs.get("ignore_index", -100))  # type: ignore[call-overload]
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = _shifted_labels(labels, ignore_index)
    assert isinstance(shift_labels, torch.Tensor)
    num_items = kwargs.get("num_items_in_batch")
    loss = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        self.lm_head.weight,
        shift_labels.reshape(-1).to(hidden.device),
        bias=self.lm_head.bias,
        ignore_index=ignore_index,
        reduction="mean" if num_items is None else "sum",
    )
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    return loss


def _replacement(linear_cross_entropy: Callable[..., torch.Tensor]) -> Variant:
    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: object = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: object,
    ) -> object:
        inputs = _base_inputs(
            input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache
        )
        if not _takes_fused_path(self, labels, logits_to_keep, kwargs):
            own = type(self).forward
            return own(self, labels=labels, logits_to_keep=logits_to_keep, **inputs, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = getattr(self, self.base_model_prefix)(**inputs, **kwargs)
        assert labels is not None
        loss = _head_loss(self, linear_cross_entropy, outputs.last_hidden_state, labels, kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    forward.__qualname__ = "causal_lm_head[linear_cross_entropy].forward"
    return Variant("fused head + loss", "torchgraft::linear_cross_entropy", forward)


def _moe_replacement(linear_cross_entropy: Callable[..., torch.Tensor]) -> Variant:
    """The same for transformers' MoE models, whose loss adds the routers' load-balancing loss
    (``output_router_logits``): computed as their forward computes it, with the
    ``load_balancing_loss_func`` that forward calls."""

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: object = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: object,
    ) -> object:
        inputs = _base_inputs(
            input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache
        )
        if not _takes_fused_path(self, labels, logits_to_keep, kwargs):
            own = type(self).forward
            return own(
                self,
                labels=labels,
                output_router_logits=output_router_logits,
                logits_to_keep=logits_to_keep,
                **inputs,
                **kwargs,
            )
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        base = getattr(self, self.base_model_prefix)
        outputs = base(**inputs, output_router_logits=output_router_logits, **kwargs)
        assert labels is not None
        loss = _head_loss(self, linear_cross_entropy, outputs.last_hidden_state, labels, kwargs)
        aux_loss = None
        if output_router_logits:
            aux_loss = load_balancing_loss(self)(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )

    forward.__qualname__ = "causal_lm_head[linear_cross_entropy, router loss].forward"
    return Variant("fused head + loss + router loss", "torchgraft::linear_cross_entropy", forward)


def load_balancing_loss(module: nn.Module) -> Callable[..., torch.Tensor]:
    """The ``load_balancing_loss_func`` that ``module``'s own forward calls (a global of the
    file that defines it)."""
    return inspect.unwrap(type(module).forward).__globals__["load_balancing_loss_func"]


def _takes_router_logits(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a MoE model's (it takes ``output_router_logits``)."""
    return "output_router_logits" in inspect.signature(type(module).forward).parameters


def _router_loss_unknown(module: nn.Module) -> str:
    """Why a forward that takes ``output_router_logits`` does not add its router loss the way
    :func:`_moe_replacement` does (empty when it does, as far as can be seen before the probe:
    transformers' ``load_balancing_loss_func`` pattern)."""
    own = inspect.unwrap(type(module).forward)
    if not callable(own.__globals__.get("load_balancing_loss_func")):
        return "its forward takes output_router_logits but calls no load_balancing_loss_func"
    for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"):
        if not isinstance(getattr(module, name, None), (int, float)):
            return f"its forward takes output_router_logits but the model has no {name}"
    return ""


class CausalLMHeadAdopter:
    """A causal LM's ``lm_head`` and loss in training (transformers ``*ForCausalLM``)."""

    kind = "causal_lm_head"
    finds = "base model + nn.Linear lm_head + loss_function == transformers' ForCausalLMLoss"

    def __init__(self) -> None:
        self._variants: dict[tuple[object, bool], Variant] = {}

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            if isinstance(getattr(module, "lm_head", None), nn.Module) and isinstance(
                getattr(type(module), "loss_function", None), property
            ):
                yield self._candidate(path, module, ctx)

    def _candidate(self, path: str, module: nn.Module, ctx: Context) -> Candidate:
        c = Candidate(self.kind, path, type(module).__name__, module, "forward", "forward")
        fn, missing = ctx.functional_op("linear_cross_entropy")
        why = missing or _not_plain(module)
        if fn is None or why:
            c.status, c.reason = SKIPPED, why
            return c
        moe = _takes_router_logits(module)
        if (fn, moe) not in self._variants:
            self._variants[fn, moe] = (_moe_replacement if moe else _replacement)(fn)
        c.own = module.forward
        c.variants = (self._variants[fn, moe],)
        c.cases = functools.partial(_cases, module, moe)
        c.run = functools.partial(_run, module)
        c.preference_key = (self.kind, type(module))
        c.check = recheck
        c.verified = Verified(
            guard.child(module, "lm_head"), getattr(module, "loss_type", None), module.loss_function
        )
        return c


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes with which a model transforms its logits after the head."""
LABELS_POSITION = 5
"""Where ``labels`` sits among the forward's positional parameters."""


def _not_plain(module: nn.Module) -> str:
    """Why the fused path could compute something else than the module's forward, if so."""
    head = module.lm_head
    if not is_transformers_causal_lm_loss(module.loss_function):
        return "loss_function is not transformers' ForCausalLMLoss"
    if type(head) is not nn.Linear:
        return f"lm_head is {type(head).__name__}, not nn.Linear"
    if head._forward_hooks or head._forward_pre_hooks:
        return "lm_head has hooks (they would not see the fused computation)"
    base = getattr(module, str(getattr(module, "base_model_prefix", "")), None)
    if not isinstance(base, nn.Module) or base is module:
        return "no base model (base_model_prefix) to run without the head"
    if head.weight.is_meta:
        return "parameters on the meta device: load the weights first"
    if _takes_router_logits(module) and (why := _router_loss_unknown(module)):
        return why
    return _logits_transformed(module)


def _logits_transformed(module: nn.Module, per_call: bool = False) -> str:
    """Which config attribute transforms the logits after the head, if any. ``per_call``: read
    only the config's own dict (a class attribute changes with the class, and transformers'
    configs answer ``getattr`` slowly: tens of microseconds for three names)."""
    config = module.__dict__.get("config")
    own = vars(config) if config is not None else {}
    for name in LOGIT_TRANSFORMS:
        value = own.get(name) if per_call else getattr(config, name, None)
        if value is not None and value != 1:
            return f"config.{name} transforms the logits after the head"
    return ""


@dataclass(frozen=True)
class Verified:
    """What an adopted head was verified with (re-checked by :func:`recheck`)."""

    lm_head: guard.Child
    loss_type: object
    """The model's ``loss_type`` (what its default ``loss_function`` resolves by)."""
    loss: object
    """Its ``loss_function`` (transformers' ``ForCausalLMLoss``)."""


def recheck(
    module: nn.Module, verified: Verified, args: tuple[object, ...], kwargs: dict[str, object]
) -> str:
    """Why a training call with labels must run the model's own forward: the fused path reads
    ``lm_head.weight`` without calling ``lm_head`` and computes ``ForCausalLMLoss`` itself, so
    ``lm_head`` must be the plain ``nn.Linear`` verified without hooks, no global module hooks
    may be set, the loss must still be transformers' ``ForCausalLMLoss`` and the logits must
    not be transformed. Calls the fused path does not take (evaluation, no labels) are the
    model's own anyway: nothing to check."""
    labels = args[LABELS_POSITION] if len(args) > LABELS_POSITION else kwargs.get("labels")
    if not module.training or labels is None:
        return ""
    why = guard.child_changed(module, verified.lm_head) or guard.global_hooks()
    if why:
        return why
    loss = module.__dict__.get("_loss_function")
    if loss is None:
        if getattr(module, "loss_type", None) != verified.loss_type:
            return "its loss_type changed"
    elif loss is not verified.loss:
        own = loss.own if isinstance(loss, guard.GuardedFunction) else loss  # the loss adopter's
        if own is not verified.loss and not is_transformers_causal_lm_loss(own):
            return f"loss_function is {getattr(loss, '__qualname__', loss)}, not ForCausalLMLoss"
    return _logits_transformed(module, per_call=True)


def _cases(module: nn.Module, moe: bool) -> list[Case]:
    """A short random batch in train mode (the only mode the fused path serves), with padding
    labels, and once more as gradient accumulation passes it (``num_items_in_batch``). A MoE
    model also runs with its router loss asked for and an attention mask with padding (which
    that loss reads), whatever its config says."""
    gen = torch.Generator().manual_seed(0)
    vocab = module.lm_head.weight.shape[0]
    device = module.lm_head.weight.device
    ids = torch.randint(0, vocab, (2, 8), generator=gen).to(device)
    labels = ids.clone()
    labels[0, :3] = -100
    leaves = tuple(
        dict.fromkeys(
            p
            for p in (module.lm_head.weight, _input_embedding_weight(module))
            if p is not None and p.requires_grad
        )
    )
    common = {"input_ids": ids, "labels": labels}
    extra = {"num_items_in_batch": torch.tensor(11, device=device)}
    cases = [
        Case("train", (), dict(common), leaves=leaves, training=True),
        Case("train, num_items_in_batch", (), {**common, **extra}, leaves=leaves, training=True),
    ]
    if moe:
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        routed = {**common, "output_router_logits": True, "attention_mask": mask}
        cases.append(Case("train, router loss", (), routed, leaves=leaves, training=True))
    return cases


def _input_embedding_weight(module: nn.Module) -> torch.Tensor | None:
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    """The loss (and a MoE model's router loss): the outputs both paths give (the fused one has
    no logits)."""
    with training_mode(module, case.training):
        out = fn(*case.args, **case.kwargs)
    return out.loss, getattr(out, "aux_loss", None)  # type: ignore[attr-defined]
