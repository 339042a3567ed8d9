"""The causal-LM head and its loss in training: ``lm_head`` + transformers' ``ForCausalLMLoss``,
routed to ``torchgraft.functional.linear_cross_entropy`` so that the logits never exist.

A transformers ``*ForCausalLM`` computes ``logits = lm_head(hidden)`` over every token, then the
loss upcasts them to float32: at 8192 tokens and a 128k vocabulary that is gigabytes of logits,
their float32 copy and their gradient. The replacement forward runs the model's own base model
(``self.model``), then the fused, chunked head + loss on its last hidden state, with
``ForCausalLMLoss``'s semantics (labels shifted left and padded with ``ignore_index`` unless
``shift_labels`` is given; mean over the tokens not ignored, or a sum divided by
``num_items_in_batch``).

It takes that path only when it changes nothing but the memory: the module is training, labels
are given, every position's logits are asked for (``logits_to_keep=0``) and a dict output is
expected. Then the output's ``logits`` is ``None`` (as Liger-Kernel's fused loss gives in
training); every other call runs the model's own forward unchanged. Found on modules with a
base model (``base_model_prefix``), an ``nn.Linear`` ``lm_head`` without hooks and transformers'
``ForCausalLMLoss``; skipped where the logits are transformed after the head (Gemma 2/3's final
soft-capping), and, like every adopter, adopted only where the probe (the whole model's loss and
the head's and embedding's gradients, on a short random batch) agrees with the model's own.
"""

from __future__ import annotations

import functools
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
        fused = (
            self.training
            and labels is not None
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and kwargs.get("return_dict", True) is not False
        )
        if not fused:
            return type(self).forward(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = getattr(self, self.base_model_prefix)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
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
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    forward.__qualname__ = "causal_lm_head[linear_cross_entropy].forward"
    return Variant("fused head + loss", "torchgraft::linear_cross_entropy", forward)


class CausalLMHeadAdopter:
    """A causal LM's ``lm_head`` and loss in training (transformers ``*ForCausalLM``)."""

    kind = "causal_lm_head"
    finds = "base model + nn.Linear lm_head + loss_function == transformers' ForCausalLMLoss"

    def __init__(self) -> None:
        self._variant: tuple[Callable[..., object], Variant] | None = None

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
        if self._variant is None or self._variant[0] is not fn:
            self._variant = (fn, _replacement(fn))
        c.own = module.forward
        c.variants = (self._variant[1],)
        c.cases = functools.partial(_cases, module)
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


def _cases(module: nn.Module) -> list[Case]:
    """A short random batch in train mode (the only mode the fused path serves), with padding
    labels, and once more as gradient accumulation passes it (``num_items_in_batch``)."""
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
    return [
        Case("train", (), dict(common), leaves=leaves, training=True),
        Case(
            "train, num_items_in_batch",
            (),
            {**common, "num_items_in_batch": torch.tensor(11, device=device)},
            leaves=leaves,
            training=True,
        ),
    ]


def _input_embedding_weight(module: nn.Module) -> torch.Tensor | None:
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    """The loss: the one output both paths give (the fused one has no logits)."""
    with training_mode(module, case.training):
        return fn(*case.args, **case.kwargs).loss  # type: ignore[attr-defined]
