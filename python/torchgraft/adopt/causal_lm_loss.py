"""The causal-LM loss: transformers' ``ForCausalLMLoss`` (``F.cross_entropy`` on float32 logits),
routed to ``torchgraft.functional.cross_entropy`` (float32 loss from logits of any dtype, without
the float32 copy of the logits).

Found on modules with an ``lm_head`` whose ``loss_function`` is transformers' ``ForCausalLMLoss``;
installed as the model's own ``loss_function`` (transformers' setter), so a loss the user set is
never overridden. Semantics follow ``ForCausalLMLoss``: labels shifted left and padded with
``ignore_index`` (unless ``shift_labels`` is given), mean over the non-ignored tokens, or a sum
divided by ``num_items_in_batch`` when that is given (gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant
from torchgraft.adopt.probe import Case, random_tensor
from torchgraft.adopt.report import SKIPPED

SLOT = "_loss_function"
"""Where transformers' ``loss_function`` setter keeps a model's own loss."""


def _replacement(cross_entropy: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def ForCausalLMLoss(  # the name transformers gives it
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        logits = logits.reshape(-1, vocab_size)
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    return ForCausalLMLoss


def is_transformers_causal_lm_loss(fn: object) -> bool:
    """Whether ``fn`` is transformers' own ``ForCausalLMLoss`` (checked without importing
    transformers)."""
    return getattr(fn, "__name__", "") == "ForCausalLMLoss" and str(
        getattr(fn, "__module__", "")
    ).startswith("transformers.")


class CausalLMLossAdopter:
    """A causal LM's loss (modules with ``lm_head`` and transformers' ``loss_function``)."""

    kind = "causal_lm_loss"
    finds = "lm_head + loss_function == transformers' ForCausalLMLoss"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            if not (
                hasattr(module, "lm_head")
                and isinstance(getattr(type(module), "loss_function", None), property)
            ):
                continue
            yield self._candidate(path, module, ctx)

    def _candidate(self, path: str, module: nn.Module, ctx: Context) -> Candidate:
        base = Candidate(self.kind, path, type(module).__name__, module, SLOT, "attribute")
        own = module.loss_function
        if not is_transformers_causal_lm_loss(own):
            base.status, base.reason = (
                SKIPPED,
                (f"loss_function is {getattr(own, '__qualname__', own)!s}, not ForCausalLMLoss"),
            )
            return base
        cross_entropy, missing = ctx.functional_op("cross_entropy")
        if cross_entropy is None:
            base.status, base.reason = SKIPPED, missing
            return base
        base.own = own
        base.variants = (
            Variant("ForCausalLMLoss", "torchgraft::cross_entropy", _replacement(cross_entropy)),
        )
        base.cases = _cases
        base.run = lambda fn, case: fn(*case.args, **case.kwargs)
        return base


def _cases() -> list[Case]:
    """Random logits (float32, bfloat16) and labels with ignored positions; mean, sum over
    ``num_items_in_batch``, and given ``shift_labels``."""
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    batch, seq, vocab = 2, 6, 13
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        logits = random_tensor((batch, seq, vocab), gen, dtype, cpu, scale=3.0)
        logits.requires_grad_(True)
        labels = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels[0, 2] = labels[1, 0] = -100
        shifted = torch.randint(0, vocab, (batch, seq), generator=gen)
        shifted[1, 3] = -100
        name = str(dtype).removeprefix("torch.")
        common = {"logits": logits, "labels": labels, "vocab_size": vocab}
        for label, extra in (
            ("mean", {}),
            ("sum / num_items_in_batch", {"num_items_in_batch": torch.tensor(7)}),
            ("shift_labels", {"shift_labels": shifted}),
        ):
            cases.append(Case(f"{name}, {label}", (), {**common, **extra}, leaves=(logits,)))
    return cases
