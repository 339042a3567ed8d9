"""RMSNorm layers, routed to ``torchgraft.functional.rms_norm`` (``torchgraft::rms_norm``: one
kernel forward, one backward, the model's own rounding), else to ``F.rms_norm``
(``aten::_fused_rms_norm``, which torchgraft grafts).

Models write RMSNorm by hand in a few ways that differ in where they round (transformers 5.x).
With ``n = x.float() * rsqrt(mean(x.float()^2) + eps)``:

- llama-style: ``weight * n.to(x.dtype)`` (Llama, Mistral, Qwen2/3, Phi3, most families);
- fp32-weight: ``(weight.float() * n).to(x.dtype)`` (OLMo2, Moshi, Gemma3n);
- gemma-style: ``(n * (1 + weight.float())).to(x.dtype)`` (Gemma, Gemma2/3, Qwen3.5);
- unweighted: ``n.to(x.dtype)`` (NanoChat).

``torchgraft.functional.rms_norm`` computes each of them in one kernel each way, rounding where
the model rounds (``cast_before_weight`` for llama-style, ``offset=1`` for gemma-style). Where this
build has no such op, or a layer's probe disagrees with it (a float64 Gemma norm computes in
float32), the ``F.rms_norm`` routes serve as fallbacks: ``F.rms_norm(x, [H], None, eps)`` is
exactly ``n.to(x.dtype)`` (fp32 accumulation, one rounding), so llama-style multiplies the
weight afterwards, as the model does, and the fp32 variants normalize and scale in fp32 and
cast once (two or three kernels). With ``fuse_weight=True`` those fallbacks put the weight into
the fused kernel: one kernel, one rounding fewer than the model. Which variant a layer computes
is not assumed from its name: every candidate is probed (random input and weight, float32 and
bfloat16, train and eval, forward and backward) and takes the variant that agrees best; a layer
no variant matches is left alone. ``nn.RMSNorm`` already calls ``F.rms_norm`` and is reported as
native.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchgraft.adopt.base import Candidate, Context, Variant, hub_name, single_input
from torchgraft.adopt.probe import Case, random_tensor, swapped_parameters, training_mode
from torchgraft.adopt.report import NATIVE, SKIPPED

OP = "aten::_fused_rms_norm"
FUSED_OP = "torchgraft::rms_norm"
FUNCTIONAL_OP = "rms_norm"
"""``torchgraft.functional.rms_norm``: looked up at each adopt call."""
HUB_NAME = "RMSNorm"
EPS_ATTRS = ("variance_epsilon", "eps")
"""Where models keep epsilon (transformers: ``variance_epsilon`` or ``eps``; torchtitan ``eps``)."""
_NAME = re.compile(r"rms_?norm$", re.IGNORECASE)
"""Class names taken as RMSNorm candidates even without the hub tag (e.g. ``GemmaRMSNorm``);
gated variants (``...RMSNormGated``) take two inputs and are not RMSNorm layers here."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm`` over the last dimension, in ``x``'s dtype even under autocast.

    CUDA autocast runs ``rms_norm`` in float32; the layers being replaced compute in float32
    themselves and cast back, so autocast is switched off around the call: the result (and
    rounding) is the model's, and the graft gets the activation's own dtype.
    """
    shape = (x.shape[-1],)
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x, shape, weight, eps)


# How each variant computes the model's formula with F.rms_norm, from (x, weight, eps).
Formula = Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def _llama_style(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return w * rms_norm(x, None, eps)


def _fp32_weight(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    assert w is not None
    if w.dtype == x.dtype:
        # The fused op scales in float32 and rounds once: the model's own formula.
        return rms_norm(x, w, eps)
    return rms_norm(x.float(), w.float(), eps).to(x.dtype)


def _gemma_style(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    assert w is not None
    return rms_norm(x.float(), 1.0 + w.float(), eps).to(x.dtype)


def _unweighted(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return rms_norm(x, None, eps)


# fuse_weight=True: the weight is applied inside the fused kernel, one rounding fewer than the
# model (faster: one kernel instead of two or three; verified within the dtype's tolerance).
def _llama_fused(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    assert w is not None
    return rms_norm(x, w, eps) if w.dtype == x.dtype else _llama_style(x, w, eps)


def _gemma_fused(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    assert w is not None
    if w.dtype != x.dtype:  # keep a float32 weight's precision (mixed precision)
        return _gemma_style(x, w, eps)
    return rms_norm(x, (1.0 + w.float()).to(x.dtype), eps)


EXACT: tuple[tuple[str, Formula], ...] = (
    ("llama-style", _llama_style),
    ("fp32-weight", _fp32_weight),
    ("gemma-style (1 + weight)", _gemma_style),
)
FUSED: tuple[tuple[str, Formula], ...] = (
    ("fp32-weight", _fp32_weight),  # first: ties with the next where the dtypes agree
    ("llama-style, weight fused", _llama_fused),
    ("gemma-style (1 + weight), weight fused", _gemma_fused),
)
UNWEIGHTED: tuple[tuple[str, Formula], ...] = (("unweighted", _unweighted),)

# The variants as torchgraft.functional.rms_norm computes them: (name, offset, cast_before_weight).
WITH_OP: tuple[tuple[str, float, bool], ...] = (
    ("llama-style", 0.0, True),
    ("fp32-weight", 0.0, False),
    ("gemma-style (1 + weight)", 1.0, False),
)


def _op_formula(
    op: Callable[..., torch.Tensor], offset: float, cast_before_weight: bool
) -> Formula:
    """A variant through ``op`` (``torchgraft.functional.rms_norm``)."""
    if offset == 0.0 and not cast_before_weight:
        return lambda x, w, eps: op(x, w, eps)
    return lambda x, w, eps: op(x, w, eps, offset=offset, cast_before_weight=cast_before_weight)


def _op_variants(
    op: Callable[..., torch.Tensor], weighted: bool, eps_attr: str
) -> tuple[Variant, ...]:
    if not weighted:
        return (
            _forward("unweighted", lambda x, w, eps: op(x, None, eps), False, eps_attr, FUSED_OP),
        )
    return tuple(
        _forward(name, _op_formula(op, offset, cast), True, eps_attr, FUSED_OP)
        for name, offset, cast in WITH_OP
    )


def _forward(
    name: str, formula: Formula, weighted: bool, eps_attr: str, op: str = OP, fallback: bool = False
) -> Variant:
    """The replacement ``forward``: reads the weight and epsilon from the module at call time."""
    if weighted:

        def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            return formula(hidden_states, self.weight, getattr(self, eps_attr))
    else:

        def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            return formula(hidden_states, None, getattr(self, eps_attr))

    forward.__qualname__ = f"rms_norm[{name}, {eps_attr}, {op}].forward"
    return Variant(name, op, forward, fallback=fallback)


# Built once: adopted layers of every model share these functions (and the kernels layer classes).
# Keys: (has a weight, epsilon attribute, fuse_weight, fallback).
VARIANTS: dict[tuple[bool, str, bool, bool], tuple[Variant, ...]] = {
    (weighted, attr, fused, fallback): tuple(
        _forward(name, formula, weighted, attr, fallback=fallback)
        for name, formula in (UNWEIGHTED if not weighted else FUSED if fused else EXACT)
    )
    for weighted in (True, False)
    for attr in EPS_ATTRS
    for fused in (False, True)
    for fallback in (False, True)
}
# Through torchgraft.functional.rms_norm, built on first use per op function.
# Keys: (the op, has a weight, epsilon attribute).
_OP_VARIANTS: dict[tuple[object, bool, str], tuple[Variant, ...]] = {}


def variants(weighted: bool, eps_attr: str, ctx: Context) -> tuple[Variant, ...]:
    """The variants to probe, best route first: through torchgraft.functional.rms_norm where
    this build has it (the F.rms_norm routes then as fallbacks), else through F.rms_norm."""
    op, _missing = ctx.functional_op(FUNCTIONAL_OP)
    if op is None:
        return VARIANTS[(weighted, eps_attr, ctx.fuse_weight, False)]
    key = (op, weighted, eps_attr)
    if key not in _OP_VARIANTS:
        _OP_VARIANTS[key] = _op_variants(op, weighted, eps_attr)  # type: ignore[arg-type]
    return _OP_VARIANTS[key] + VARIANTS[(weighted, eps_attr, ctx.fuse_weight, True)]


class RMSNormAdopter:
    """RMSNorm layers: by the hub tag ``RMSNorm``, by class name (``...RMSNorm``), and
    ``nn.RMSNorm`` (native already)."""

    kind = "rms_norm"
    finds = "hub tag 'RMSNorm', class name '...RMSNorm', nn.RMSNorm"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            tag = hub_name(module)
            native = isinstance(module, nn.RMSNorm)
            if id(module) in ctx.claimed or not (
                native or tag == HUB_NAME or _NAME.search(type(module).__name__)
            ):
                continue
            ctx.claimed.add(id(module))
            c = Candidate(
                self.kind, path, type(module).__name__, module, "forward", "forward", hub_name=tag
            )
            if native:
                c.status, c.route = NATIVE, f"F.rms_norm -> {OP}"
                c.reason = "nn.RMSNorm calls F.rms_norm already"
            else:
                _plan(c, module, ctx)
            yield c


def _plan(c: Candidate, module: nn.Module, ctx: Context) -> None:
    """Fill in the variants and probes of a hand-written RMSNorm, or why it is skipped."""
    why = _not_plain(module)
    if why:
        c.status, c.reason = SKIPPED, why
        return
    eps_attr = next(a for a in EPS_ATTRS if isinstance(getattr(module, a, None), float | int))
    weight = module._parameters.get("weight")
    hidden = weight.shape[0] if weight is not None else 16
    c.own = module.forward
    c.variants = variants(weight is not None, eps_attr, ctx)
    c.cases = functools.partial(_cases, module, hidden)
    c.run = functools.partial(_run, module)
    c.preference_key = ("rms_norm", type(module))
    c.check = recheck
    c.verified = Verified(weight is not None, eps_attr, frozenset(_dtype_pairs(module)))


@dataclass(frozen=True)
class Verified:
    """What an adopted RMSNorm was verified with (re-checked on each call by :func:`recheck`)."""

    weighted: bool
    eps_attr: str
    dtypes: frozenset[tuple[torch.dtype, torch.dtype | None]]
    """(input dtype, weight dtype) pairs the probe covered."""


def recheck(
    module: nn.Module, verified: Verified, args: tuple[object, ...], kwargs: dict[str, object]
) -> str:
    """Why this call must run the layer's own forward (empty: the replacement may serve it)."""
    weight = module._parameters.get("weight")
    if verified.weighted != (weight is not None):
        return "its weight was removed" if weight is None else "it has a weight now"
    if weight is not None and weight.dim() != 1:
        return f"weight is now {tuple(weight.shape)}, not a vector"
    own, attr = module.__dict__, verified.eps_attr
    if not isinstance(own[attr] if attr in own else getattr(module, attr, None), float | int):
        return f"{verified.eps_attr} is not a number any more"
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return "called with other arguments than one input tensor"
    # Only float dtypes were verified: this also refuses an integer (quantized) weight.
    pair = (args[0].dtype, None if weight is None else weight.dtype)
    if pair not in verified.dtypes:
        return f"input {_short(pair[0])} with weight {_short(pair[1])} was not verified"
    return ""


def _not_plain(module: nn.Module) -> str:
    """Why ``module`` is not a plain one-input RMSNorm we can probe (empty if it is)."""
    if any(True for _ in module.children()):
        return "not a plain RMSNorm: it has sub-modules"
    extra = set(module._parameters) - {"weight"}
    if extra:
        return f"not a plain RMSNorm: parameters {sorted(extra)} besides weight"
    if not any(isinstance(getattr(module, a, None), float | int) for a in EPS_ATTRS):
        return f"no epsilon attribute ({' or '.join(EPS_ATTRS)})"
    weight = module._parameters.get("weight")
    if weight is not None and (weight.dim() != 1 or not weight.is_floating_point()):
        return f"weight is {weight.dtype} {tuple(weight.shape)}, not a 1-D float vector"
    if weight is not None and weight.is_meta:
        return "parameters on the meta device: load the weights first"
    if not single_input(module.forward):
        return "forward takes other arguments than one input (gated RMSNorm?)"
    return ""


def _dtype_pairs(module: nn.Module) -> list[tuple[torch.dtype, torch.dtype | None]]:
    """(input, weight) dtypes to probe: the module's own, float32, bfloat16 and float16, and the
    half-precision inputs with a float32 weight (mixed precision). ``None``: no weight."""
    weight = module._parameters.get("weight")
    own = weight.dtype if weight is not None else torch.float32
    half = (torch.bfloat16, torch.float16)
    pairs = [(own, own), (torch.float32, torch.float32)] + [(h, h) for h in half]
    if weight is not None:
        pairs += [(h, torch.float32) for h in half]
    else:
        pairs = [(x, None) for x, _ in pairs]
    return list(dict.fromkeys(pairs))


def _cases(module: nn.Module, hidden: int) -> list[Case]:
    """Random input and weight in each of :func:`_dtype_pairs`, in train and eval mode."""
    weight = module._parameters.get("weight")
    device = weight.device if weight is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    cases = []
    for x_dtype, w_dtype in _dtype_pairs(module):
        x = random_tensor((2, 3, hidden), gen, x_dtype, device, scale=2.0, offset=0.25)
        x.requires_grad_(True)
        params: dict[str, nn.Parameter] = {}
        if weight is not None and w_dtype is not None:
            w = random_tensor((hidden,), gen, w_dtype, device, scale=0.5, offset=1.0)
            params["weight"] = nn.Parameter(w)
        for training in (True, False):
            label = f"x {_short(x_dtype)}, weight {_short(w_dtype)}, " + (
                "train" if training else "eval"
            )
            leaves = (x, *params.values())
            cases.append(Case(label, (x,), leaves=leaves, params=params, training=training))
    return cases


def _short(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    with swapped_parameters(module, case.params), training_mode(module, case.training):
        return fn(*case.args, **case.kwargs)
