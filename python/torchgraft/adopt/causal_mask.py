"""The causal mask under ``torch.compile``: transformers' ``_ignore_causal_mask_sdpa``, so that a
compiled model's SDPA calls take ``is_causal=True`` instead of a materialized mask, as the same
model's eager calls do.

In eager mode transformers passes SDPA no mask when the mask would only say "causal" (no padding,
no sliding window reaching back past the keys): SDPA then runs its causal kernels (cuDNN's or
flash's). While tracing it never does: ``masking_utils._ignore_causal_mask_sdpa`` returns False
whenever ``is_tracing()``, because an *exported* graph would hard-code that decision. A compiled
model therefore builds a ``(batch, 1, q, kv)`` boolean mask in every step and SDPA takes its
masked path: on the H100 the 1b Llama's compiled attention ran 2.8x slower than eager's.

The replacement decides, under ``torch.compile`` (not ``torch.export``)
and for calls without a padding mask only, exactly as transformers decides when not tracing;
dynamo guards on the sizes the decision reads, so a graph is reused only where it holds. Every
other call (eager, export, jit or fx tracing, a padding mask) is the model's own function. The
probe checks both halves of that claim: on calls without padding, the rule is transformers' own
eager rule, and SDPA with ``is_causal`` computes what the mask transformers would build computes
(forward and backward, sliding windows and decoding offsets included).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, global_candidate
from torchgraft.adopt.probe import Case, random_tensor

MODULE = "transformers.masking_utils"
FUNCTION = "_ignore_causal_mask_sdpa"
PARAMETERS = ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset")
OP = "aten::scaled_dot_product_attention"


def compiling() -> bool:
    """Whether dynamo is tracing for ``torch.compile`` (and not for ``torch.export``).

    Not ``torch.compiler.is_exporting()``: before torch 2.15 dynamo folds it to True inside every
    trace, ``torch.compile``'s too. The flag it reads is set by export alone, on every torch
    since 2.4, and dynamo reads (and guards) a module global as it is."""
    return torch.compiler.is_compiling() and not getattr(torch.compiler, "_is_exporting_flag", True)


def skips_mask(
    q_length: int, kv_length: int, q_offset: int, local_attention_size: int | None
) -> bool:
    """transformers' eager rule for a call without a padding mask: SDPA's ``is_causal`` (or no
    mask at all when one query attends every key) computes what the mask would."""
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    return q_length == 1 or kv_length == q_length or q_offset == 0


def _replacement(own: Callable[..., bool]) -> Callable[..., bool]:
    def _ignore_causal_mask_sdpa(
        padding_mask: torch.Tensor | None,
        q_length: int,
        kv_length: int,
        q_offset: int,
        kv_offset: int,
        local_attention_size: int | None = None,
    ) -> bool:
        if padding_mask is None and compiling():
            return skips_mask(q_length, kv_length, q_offset, local_attention_size)
        return own(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    _ignore_causal_mask_sdpa.__qualname__ = f"causal_mask[{MODULE}].{FUNCTION}"
    _ignore_causal_mask_sdpa.own = own  # type: ignore[attr-defined]  (read by the probe)
    return _ignore_causal_mask_sdpa


class CausalMaskAdopter:
    """transformers' SDPA causal-mask skip, extended to ``torch.compile`` (models whose attention
    implementation is ``sdpa``)."""

    kind = "causal_mask"
    finds = f"{MODULE}.{FUNCTION} for models with attn_implementation 'sdpa'"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        pymod = sys.modules.get(MODULE)
        config = getattr(model, "config", None)
        if pymod is None or getattr(config, "_attn_implementation", None) != "sdpa":
            return
        if not callable(getattr(pymod, FUNCTION, None)):
            return
        yield self._candidate(pymod)

    def _candidate(self, pymod: types.ModuleType) -> Candidate:
        c = global_candidate(self.kind, pymod, FUNCTION, _variant, _not_plain)
        c.cases = _cases if c.own is not None else None
        c.run = _run
        return c


def _variant(own: Callable[..., bool]) -> Variant:
    return Variant("is_causal under torch.compile", OP, _replacement(own))


def _not_plain(own: Callable[..., object]) -> str:
    if _plain_signature(own):
        return ""
    return f"signature is not ({', '.join(PARAMETERS)}, ...)"


def _plain_signature(fn: object) -> bool:
    try:
        names = tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return names[: len(PARAMETERS)] == PARAMETERS and names[len(PARAMETERS) :] in (
        ("local_attention_size",),
        (),
    )


# (q_length, kv_length, q_offset, sliding window): prefill, prefill into a longer static cache,
# decoding one token, and sliding windows that do and do not reach back past the keys.
SHAPES: tuple[tuple[int, int, int, int | None], ...] = (
    (6, 6, 0, None),
    (4, 7, 0, None),
    (1, 5, 4, None),
    (6, 6, 0, 3),
    (6, 6, 0, 8),
)


def _cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    batch, heads, dim = 2, 3, 8
    cases = []
    for q_len, kv_len, q_offset, window in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            q = random_tensor((batch, heads, q_len, dim), gen, dtype, cpu).requires_grad_(True)
            k = random_tensor((batch, heads, kv_len, dim), gen, dtype, cpu).requires_grad_(True)
            v = random_tensor((batch, heads, kv_len, dim), gen, dtype, cpu).requires_grad_(True)
            label = f"q {q_len}, kv {kv_len}, offset {q_offset}, window {window}, " + str(
                dtype
            ).removeprefix("torch.")
            cases.append(Case(label, (q, k, v, q_offset, window), leaves=(q, k, v)))
    return cases


def _run(fn: Callable[..., object], case: Case) -> torch.Tensor:
    """Attention as a compiled model computes it with ``fn`` deciding. The model's own function
    never skips there (its tracing branch): transformers' materialized mask. The replacement
    follows the eager rule, which must be the model's own (checked here on each case)."""
    q, k, v, q_offset, window = case.args
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor) and isinstance(q_offset, int)
    assert window is None or isinstance(window, int)
    q_len, kv_len = q.shape[-2], k.shape[-2]
    own = getattr(fn, "own", None)
    skip = False
    if own is not None:
        skip = skips_mask(q_len, kv_len, q_offset, window)
        if bool(own(None, q_len, kv_len, q_offset, 0, window)) != skip:
            raise ValueError("its rule is not transformers' own eager rule")
    if skip:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(q_len, kv_len, q_offset, window))


def _mask(q_len: int, kv_len: int, q_offset: int, window: int | None) -> torch.Tensor:
    """The boolean mask transformers builds (``sdpa_mask`` without the skip)."""
    from transformers import masking_utils as mu

    function = mu.causal_mask_function
    if window is not None:
        function = mu.sliding_window_causal_mask_function(window)
    mask = mu.sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=q_offset,
        mask_function=function,
        local_size=window,
        allow_is_causal_skip=False,
    )
    assert mask is not None
    return mask
