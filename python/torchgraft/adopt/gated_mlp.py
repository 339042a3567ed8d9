"""Gated MLPs (``down(act(gate(x)) * up(x))``), routed to ``torchgraft.functional.swiglu`` /
``geglu`` for the gating; the three projections stay the model's own ``nn.Linear`` modules (so
their hooks, LoRA wrappers and quantized weights keep working).

Found by structure: children named like transformers' and torchtitan's MLPs (the table below),
with the activation told apart by its class or hub tag. Enabled only when this build's
``torchgraft.functional`` provides the op; every candidate is probed with its own weights
(forward and backward, train and eval) before its forward is replaced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from torchgraft.adopt import guard
from torchgraft.adopt.base import Candidate, Context, Variant, hub_name, single_input
from torchgraft.adopt.probe import Case, random_tensor, training_mode
from torchgraft.adopt.report import SKIPPED


@dataclass(frozen=True)
class Layout:
    """Where a gated MLP keeps its projections and activation."""

    name: str
    down: str
    gate: str = ""
    up: str = ""
    gate_up: str = ""
    """One projection giving ``[gate, up]`` halves (``chunk(2, dim=-1)``, as Phi3)."""
    activations: tuple[str, ...] = ("act_fn", "activation_fn", "act")
    """Attribute names of the activation module; empty: the forward calls SiLU itself."""


LAYOUTS = (
    Layout("gate_proj/up_proj/down_proj", down="down_proj", gate="gate_proj", up="up_proj"),
    Layout("gate_up_proj/down_proj", down="down_proj", gate_up="gate_up_proj"),
    Layout("w1/w3/w2 (torchtitan)", down="w2", gate="w1", up="w3", activations=()),
)

# Activation -> (functional op, its keyword arguments). By nn class, then by hub tag.
_BY_CLASS: tuple[tuple[type[nn.Module], Callable[[nn.Module], tuple[str, dict[str, str]]]], ...] = (
    (nn.SiLU, lambda m: ("swiglu", {})),
    (nn.GELU, lambda m: ("geglu", {"approximate": m.approximate})),
)
# transformers' activation classes by name: their hub tag is only set when the `kernels` package
# is installed. (The probe verifies every match before anything is adopted.)
_BY_CLASS_NAME = {
    "SiLUActivation": ("swiglu", {}),
    "GELUActivation": ("geglu", {"approximate": "none"}),
    "GELUTanh": ("geglu", {"approximate": "tanh"}),
    "NewGELUActivation": ("geglu", {"approximate": "tanh"}),
    "FastGELUActivation": ("geglu", {"approximate": "tanh"}),
}
_BY_HUB_TAG = {
    "SiLU": ("swiglu", {}),
    "GeLU": ("geglu", {"approximate": "none"}),
    "GeluTanh": ("geglu", {"approximate": "tanh"}),
    "NewGELU": ("geglu", {"approximate": "tanh"}),
    "FastGELU": ("geglu", {"approximate": "tanh"}),
}


def gating(activation: nn.Module | None) -> tuple[str, dict[str, str]] | None:
    """The fused gated op for an activation module (``None``: the layout's implicit SiLU), or
    ``None`` when there is none."""
    if activation is None:
        return "swiglu", {}
    for cls, op in _BY_CLASS:
        if isinstance(activation, cls):
            return op(activation)
    by_tag = _BY_HUB_TAG.get(hub_name(activation) or "")
    return by_tag or _BY_CLASS_NAME.get(type(activation).__name__)


def _forward(layout: Layout, op: Callable[..., torch.Tensor], kwargs: dict[str, str]) -> Variant:
    gated = functools.partial(op, **kwargs) if kwargs else op
    if layout.gate_up:
        gate_up, down = layout.gate_up, layout.down

        def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            gate, up = getattr(self, gate_up)(hidden_states).chunk(2, dim=-1)
            return getattr(self, down)(gated(gate, up))
    else:
        g, u, down = layout.gate, layout.up, layout.down

        def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            return getattr(self, down)(
                gated(getattr(self, g)(hidden_states), getattr(self, u)(hidden_states))
            )

    name = getattr(op, "__name__", "op")
    label = name + (
        "(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")" if kwargs else ""
    )
    forward.__name__ = "forward"
    forward.__qualname__ = f"gated_mlp[{layout.name}, {label}].forward"
    return Variant(label, f"torchgraft::{name}", forward)


class GatedMLPAdopter:
    """Gated MLPs found by structure (:data:`LAYOUTS`)."""

    kind = "gated_mlp"
    finds = "children gate_proj/up_proj/down_proj, gate_up_proj/down_proj or w1/w3/w2 + activation"

    def __init__(self) -> None:
        # One replacement function per (layout, op, arguments), shared by every adopted layer.
        self._variants: dict[tuple[object, ...], Variant] = {}

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            layout = _layout(module) if id(module) not in ctx.claimed else None
            if layout is not None:
                yield self._candidate(path, module, layout, ctx)

    def _candidate(self, path: str, module: nn.Module, layout: Layout, ctx: Context) -> Candidate:
        act_name = next((a for a in layout.activations if hasattr(module, a)), None)
        activation = getattr(module, act_name) if act_name is not None else None
        # The activation is part of this layer: not reported again on its own.
        ctx.claimed.update(id(m) for m in (module, activation) if isinstance(m, nn.Module))
        c = Candidate(
            self.kind,
            path,
            type(module).__name__,
            module,
            "forward",
            "forward",
            hub_name=hub_name(module),
        )
        op = gating(activation) if activation is not None or not layout.activations else None
        if op is None:
            c.status, c.reason = SKIPPED, f"activation {type(activation).__name__} has no fused op"
            return c
        name, kwargs = op
        fn, missing = ctx.functional_op(name)
        why = missing or _not_plain(module, layout)
        if fn is None or why:
            c.status, c.reason = SKIPPED, why
            return c
        key = (layout, fn, tuple(sorted(kwargs.items())))
        if key not in self._variants:
            self._variants[key] = _forward(layout, fn, kwargs)
        c.own = module.forward
        c.variants = (self._variants[key],)
        c.cases = functools.partial(_cases, module, layout)
        c.run = functools.partial(_run, module)
        c.preference_key = (self.kind, type(module))
        c.check = recheck
        c.verified = guard.child(module, act_name) if act_name in module._modules else None
        return c


def recheck(module: nn.Module, activation: guard.Child | None, args: object, kwargs: object) -> str:
    """Why this call must run the layer's own forward: the replacement computes the activation
    module's function without calling it, so that module must be the class (and settings)
    verified, with no hooks, and no global module hooks may be set."""
    if activation is None:
        return ""
    return guard.child_changed(module, activation) or guard.global_hooks()


def _layout(module: nn.Module) -> Layout | None:
    for layout in LAYOUTS:
        names = [n for n in (layout.gate, layout.up, layout.gate_up, layout.down) if n]
        if all(_is_projection(getattr(module, n, None)) for n in names) and (
            not layout.activations or any(hasattr(module, a) for a in layout.activations)
        ):
            return layout
    return None


def _not_plain(module: nn.Module, layout: Layout) -> str:
    if not single_input(module.forward):
        return "forward does not take exactly one input"
    if getattr(module, layout.gate_up or layout.gate).weight.is_meta:
        return "parameters on the meta device: load the weights first"
    return ""


def _is_projection(m: object) -> bool:
    weight = getattr(m, "weight", None)
    return isinstance(m, nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _cases(module: nn.Module, layout: Layout) -> list[Case]:
    """A random input in the module's own dtype, with the module's own weights."""
    first = getattr(module, layout.gate_up or layout.gate)
    weight = first.weight
    hidden = weight.shape[1]
    gen = torch.Generator().manual_seed(0)
    # Quantized projections keep integer weights: feed them a float32 input.
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    x = random_tensor((2, 3, hidden), gen, dtype, weight.device).requires_grad_(True)
    params = tuple(p for p in module.parameters() if p.requires_grad)
    return [
        Case(
            f"{_short(dtype)}, {'train' if t else 'eval'}",
            (x,),
            leaves=(x, *params),
            training=t,
        )
        for t in (True, False)
    ]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(module: nn.Module, fn: Callable[..., object], case: Case) -> object:
    with training_mode(module, case.training):
        return fn(*case.args, **case.kwargs)
