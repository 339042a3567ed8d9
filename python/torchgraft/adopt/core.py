"""``adopt`` and ``unadopt``: walk the adoption table over a model, verify, install, report."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn

from torchgraft import control
from torchgraft.adopt import hub, slots
from torchgraft.adopt.base import Adopter, Candidate, Context, Variant
from torchgraft.adopt.causal_lm_head import CausalLMHeadAdopter
from torchgraft.adopt.causal_lm_loss import CausalLMLossAdopter
from torchgraft.adopt.causal_mask import CausalMaskAdopter
from torchgraft.adopt.default_positions import DefaultPositionsAdopter
from torchgraft.adopt.gated_mlp import GatedMLPAdopter
from torchgraft.adopt.guard import Guard, GuardedFunction, guarded_forward
from torchgraft.adopt.hub_layers import HubLayerReporter
from torchgraft.adopt.moe_balance_loss import MoEBalanceLossAdopter
from torchgraft.adopt.moe_experts import MoEExpertsAdopter
from torchgraft.adopt.moe_router import MoERouterAdopter
from torchgraft.adopt.probe import Verdict, compare
from torchgraft.adopt.report import (
    ADOPTED,
    ALREADY,
    KILLED,
    SKIPPED,
    AdoptionReport,
    AdoptionRow,
)
from torchgraft.adopt.rms_norm import RMSNormAdopter
from torchgraft.adopt.rope import RopeAdopter

ADOPTERS: tuple[Adopter, ...] = (
    RMSNormAdopter(),
    GatedMLPAdopter(),
    RopeAdopter(),
    MoERouterAdopter(),
    MoEExpertsAdopter(),
    MoEBalanceLossAdopter(),  # the routers' load-balancing loss, sync-free
    CausalMaskAdopter(),  # SDPA's is_causal under torch.compile
    DefaultPositionsAdopter(),  # ... also where the model derives its positions
    CausalLMHeadAdopter(),  # training with labels: no logits
    CausalLMLossAdopter(),  # every other call that computes the loss
    HubLayerReporter(),  # last: reports hub-tagged layers no adopter above claimed
)
"""The adoption table: one row per kind of layer (see each adopter's ``finds``)."""

VIA = ("auto", "forward", "kernels")

_lock = threading.RLock()


def adopt(model: nn.Module, *, via: str = "auto", fuse_weight: bool = False) -> AdoptionReport:
    """Route the layers of ``model`` that torchgraft knows to operators it grafts.

    Each layer the adoption table recognises (RMSNorm layers, gated MLPs, transformers' RoPE
    function and causal-LM loss, by kernel-hub tag, structure or ``nn`` class) is run on a small
    random probe next to its candidate replacements, forward and backward; it is adopted only
    where a replacement agrees within the dtype's tolerance, keeping the model's own numerics
    (where it rounds, what dtype it returns). Everything else is left exactly as it was, with the
    reason in the report. Parameters, buffers, ``state_dict``, hooks and the model's class are
    untouched; :func:`unadopt` puts every replaced forward back.

    Adopting routes the layers; they run torchgraft's operators while :func:`torchgraft.enable`
    is in effect (and the operator is not switched off), the model's own code otherwise. On each
    call an adopted layer re-checks what was verified (its class, the children it bypasses and
    their hooks, global module hooks, the loss function...); where that no longer holds, the
    call runs the model's own forward and a warning names the layer and the reason (see
    :mod:`torchgraft.adopt.guard`). With ``TORCHGRAFT_DISABLE=1`` (the kill switch) nothing is
    adopted: each layer is reported ``not adopted: kill switch``. Calling ``adopt`` again adopts
    what is new and reports the rest as already adopted. The global random state is left as it
    was.

    Args:
        model: any ``nn.Module`` (a transformers ``PreTrainedModel``, torchtitan-style code...),
            with its weights loaded (layers on the meta device are skipped).
        via: how layers that carry a kernel-hub tag are installed: ``"kernels"`` through the
            ``kernels`` package (``use_kernel_mapping`` + ``kernelize``, offline: torchgraft
            layer classes, no Hub), ``"forward"`` by setting the module's ``forward`` (needs
            nothing beyond torch), ``"auto"`` (default) the first where ``kernels`` is
            installed, else the second. Untagged layers always use ``"forward"``.
        fuse_weight: RMSNorm layers that multiply by their weight after casting (Llama-style)
            or add one to it (Gemma-style) get the weight inside the fused kernel: one kernel
            instead of two or three, one rounding fewer than the model (still verified within
            the dtype's tolerance). Off by default: the model's own rounding, exactly.

    Returns:
        An :class:`AdoptionReport`; ``print(report)`` shows a table.
    """
    _check_module("adopt", model)
    if via not in VIA:
        raise ValueError(f"via must be one of {VIA}, got {via!r}")
    use_kernels = via == "kernels" or (via == "auto" and hub.available())
    if via == "kernels" and not hub.available():
        raise ImportError("adopt(via='kernels') needs the kernels package (pip install kernels)")
    ctx = Context(via=via, use_kernels=use_kernels, fuse_weight=fuse_weight, killed=_killed())
    rows: list[AdoptionRow] = []
    with _lock, _probing(model):
        for adopter in ADOPTERS:
            for candidate in adopter.candidates(model, ctx):
                rows.append(_settle(model, candidate, ctx))
    return AdoptionReport(rows)


def unadopt(model: nn.Module) -> int:
    """Put back every forward (and loss function) :func:`adopt` replaced in ``model``, exactly
    as it was before, and release its hold on replaced module-global functions.

    A slot that something else has replaced since adoption is left with that newer function (a
    warning says which). Idempotent.

    Returns:
        How many replacements were undone.
    """
    _check_module("unadopt", model)
    undone = 0
    with _lock:
        for path, module in model.named_modules():
            for name, rec in list(slots.records(module).items()):
                if isinstance(rec, slots.GlobalRecord):
                    undone += slots.release_global(module, name)
                elif slots.restore(module, name):
                    undone += 1
                else:
                    warnings.warn(
                        f"torchgraft.unadopt: {path or '<model>'}.{name} was replaced after "
                        "adoption; leaving the newer one in place",
                        stacklevel=2,
                    )
    return undone


def _killed() -> bool:
    """Whether the kill switch (``TORCHGRAFT_DISABLE``) is set: nothing of torchgraft runs."""
    return control._env_flag(control.DISABLE_ENV)


def _check_module(name: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name}() expects a torch.nn.Module, got {type(model).__name__}")


@contextlib.contextmanager
def _probing(model: nn.Module) -> Iterator[None]:
    """Probes need autograd, and must not move the global random state (dropout in a layer's
    own forward draws from it)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
        yield


def _settle(model: nn.Module, c: Candidate, ctx: Context) -> AdoptionRow:
    """Verify the candidate's variants and install the best; the row says what happened."""
    if _already(model, c):
        return AdoptionRow(c.path, c.layer, c.kind, ALREADY, c.route)
    if ctx.killed:
        return AdoptionRow(c.path, c.layer, c.kind, SKIPPED, reason=KILLED)
    if c.status or not c.variants:
        reason = c.reason or "nothing to adopt"
        return AdoptionRow(c.path, c.layer, c.kind, c.status or SKIPPED, c.route, reason=reason)
    if c.slot_kind == "global" and c.cases is None:
        # Installed and verified by an earlier adopt() of another model: hold it too.
        return _install(model, c, c.variants[0], None, ctx)
    chosen, verdict = _choose(c, ctx)
    if chosen is None:
        reason = verdict.reason
        if _sharded(model):
            reason = f"{SHARDED}; {reason}"
        return AdoptionRow(
            c.path,
            c.layer,
            c.kind,
            SKIPPED,
            reason=reason,
            max_err=None if verdict.max_err == float("inf") else verdict.max_err,
        )
    ctx.preferred[c.preference_key] = chosen.name
    return _install(model, c, chosen, verdict.max_err, ctx)


SHARDED = (
    "the model's parameters are sharded (FSDP2's fully_shard): the probe cannot run its layers; "
    "call adopt() before fully_shard"
)


def _sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` sharded some of ``model``'s parameters (DTensors): a probe calls
    a layer's forward without the hooks that gather them, so it fails where it reads them."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def _already(model: nn.Module, c: Candidate) -> bool:
    if c.slot_kind == "global":
        return slots.holds_global(model, c.owner, c.slot)  # type: ignore[arg-type]
    return slots.is_installed(c.owner, c.slot)


def _choose(c: Candidate, ctx: Context) -> tuple[Variant | None, Verdict]:
    """The variant that agrees best with the layer; the variant the previous layer of the same
    class took is tried first and kept if it agrees. Fallback variants are tried only when no
    other agrees."""
    assert c.own is not None and c.cases is not None and c.run is not None
    cases = c.cases()
    preferred = ctx.preferred.get(c.preference_key) if c.preference_key is not None else None
    ordered = sorted(c.variants, key=lambda v: (v.fallback, v.name != preferred))
    best: tuple[Variant, Verdict] | None = None
    closest: tuple[Variant, Verdict] | None = None
    for variant in ordered:
        if variant.fallback and best is not None:
            break
        verdict = compare(c.own, _callable(c, variant), cases, c.run)
        if verdict.ok:
            if variant.name == preferred:
                return variant, verdict
            if best is None or verdict.score < best[1].score:
                best = (variant, verdict)
        elif closest is None or verdict.score < closest[1].score:
            closest = (variant, verdict)
    if best is not None:
        return best
    assert closest is not None
    variant, verdict = closest
    names = ", ".join(dict.fromkeys(v.name for v in c.variants))  # fallbacks may share names
    why = (
        f"no variant matches ({names}); closest, {variant.name}: {verdict.reason}"
        if len(c.variants) > 1
        else f"{variant.name} does not match: {verdict.reason}"
    )
    return None, Verdict(False, verdict.max_err, verdict.score, why)


def _callable(c: Candidate, variant: Variant) -> Callable[..., object]:
    if c.slot_kind == "forward":
        return types.MethodType(variant.function, c.owner)
    return variant.function


def _install(
    model: nn.Module, c: Candidate, variant: Variant, max_err: float | None, ctx: Context
) -> AdoptionRow:
    route = f"{variant.name} -> {variant.op}"
    via = {"forward": "forward", "attribute": c.slot.lstrip("_"), "global": "global"}[c.slot_kind]
    row = AdoptionRow(c.path, c.layer, c.kind, ADOPTED, route, via, max_err=max_err)
    op = variant.op.rpartition("::")[2]  # the bare symbol the switches name
    if c.slot_kind == "global":
        note = _joined("process-wide while an adopted model holds it", variant.note)
        row = replace(row, reason=note)
        # Held from an earlier adoption (no own): that function is guarded already.
        fn = variant.function if c.own is None else GuardedFunction(variant.function, c.own, op)
        why = slots.hold_global(model, c.owner, c.slot, fn, row)  # type: ignore[arg-type]
        return replace(row, status=SKIPPED, route="", via="", reason=why) if why else row
    if c.slot_kind == "attribute":
        assert c.own is not None
        slots.install(c.owner, c.slot, GuardedFunction(variant.function, c.own, op), row, False)
        return row
    owner = c.owner
    assert isinstance(owner, nn.Module)
    guard = Guard(op, c.path, c.layer, type(owner), type(owner).forward, c.check, c.verified)
    forward = guarded_forward(variant.function)
    if c.hub_name and ctx.use_kernels and _leaf(owner):
        row = replace(row, via="kernels")
        failure = _kernelize(c, forward, guard, row)
        if not failure:
            return row
        if ctx.via == "kernels":
            return replace(row, status=SKIPPED, reason=f"kernels declined: {failure}", max_err=None)
        row = replace(row, via="forward", reason=f"kernels declined ({failure}); set on forward")
    slots.install(owner, c.slot, forward, row, bind=True, guard=guard)
    return row


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _leaf(module: object) -> bool:
    # kernels.kernelize walks sub-modules too: only leaves are handed to it.
    return isinstance(module, nn.Module) and next(module.children(), None) is None


def _kernelize(c: Candidate, forward: Callable[..., object], guard: Guard, row: AdoptionRow) -> str:
    """Install through ``kernels.kernelize``; returns why it did not take (empty on success)."""
    module = c.owner
    assert isinstance(module, nn.Module) and c.hub_name is not None
    slots.remember(module, c.slot, forward, row, guard)
    try:
        hub.kernelize(module, c.hub_name, forward)
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    else:
        failure = "" if slots.is_installed(module, c.slot) else "it kept the layer's own forward"
    if failure:
        slots.restore(module, c.slot, force=True)
    return failure
