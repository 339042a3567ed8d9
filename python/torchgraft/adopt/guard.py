"""Call-time re-checks: an adopted layer runs its replacement only while what :func:`adopt`
verified still holds, and only while torchgraft is switched on for its operator.

:func:`torchgraft.adopt` verifies a layer once. Afterwards a user may hook a child the
replacement bypasses, wrap ``lm_head`` in LoRA, set a custom ``loss_function``, patch the class's
``forward``, parametrize a weight, or switch torchgraft off. So every adopted layer asks, on each
call and with plain attribute and dict reads (no kernel, no device sync, nothing that stops
``torch.compile(fullgraph=True)``):

- whether torchgraft runs its operator now (:func:`torchgraft.control.adopted_layers_active`);
  when not, the layer silently runs its own code (that is the user's switch);
- whether the module's class and its class's ``forward`` are those verified;
- the adopter's own conditions (:attr:`Guard.check`: children it bypasses, weights, the loss
  function, global module hooks...).

Where one fails, that call runs the model's own forward and a :class:`AdoptionFallbackWarning`
names the layer and the reason, once per layer and reason (not inside ``torch.compile``'d code,
which cannot warn; the fallback happens there too).
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as _torch_module

from torchgraft import control
from torchgraft.adopt.slots import RECORDS

Check = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], str]
"""An adopter's re-check: ``(owner, verified, args, kwargs) -> reason`` (empty while what was
verified still holds). A module-level function (so copies share it); what it compares against is
``verified``, which copies of the model copy along with the module."""


class AdoptionFallbackWarning(UserWarning):
    """An adopted layer ran the model's own forward because something changed after
    :func:`torchgraft.adopt` verified it (the message names the layer and the reason)."""


@dataclass
class Guard:
    """What one adopted layer re-checks on each call."""

    op: str
    """The operator's bare symbol (``"rms_norm"``, ``"swiglu"``), as the switches name it."""
    path: str
    """The layer's path in the adopted model (for the warning)."""
    layer: str
    """Its class name (for the warning)."""
    cls: type | None = None
    """The module's class when verified (``None`` for slots that are not a module's forward)."""
    cls_forward: object = None
    """That class's ``forward`` when verified."""
    check: Check | None = None
    verified: object = None
    """What ``check`` compares against (snapshots of children, settings, dtypes)."""
    warned: set[str] = field(default_factory=set)

    def why_not(self, owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Why the replacement must not serve this call (empty: it may)."""
        if self.cls is not None:
            cls = type(owner)
            if cls is not self.cls and not sharded_subclass(cls, self.cls):
                now, was = _names(cls, self.cls)
                return f"its class is now {now}, not {was}" + (
                    " (parametrized)" if getattr(owner, "parametrizations", None) else ""
                )
            if cls.forward is not self.cls_forward:
                return f"{cls.__name__}.forward was replaced after adoption"
        if self.check is not None:
            return self.check(owner, self.verified, args, kwargs)
        return ""

    def warn(self, reason: str) -> None:
        """Warn once per reason that this layer runs its own forward (not while compiling)."""
        if reason in self.warned or torch.compiler.is_compiling():
            return
        self.warned.add(reason)
        warnings.warn(
            f"torchgraft: {self.path or '<model>'} ({self.layer}) runs the model's own forward: "
            f"{reason}",
            AdoptionFallbackWarning,
            stacklevel=5,  # the caller of the module (warn, forward, _call_impl, __call__)
        )


_guarded_forwards: dict[Callable[..., object], Callable[..., object]] = {}


def guarded_forward(replacement: Callable[..., object]) -> Callable[..., object]:
    """The ``forward`` installed on adopted modules: ``replacement`` while the module's guard
    (in its records) holds, else the module's own forward. One per replacement, shared by every
    module that takes it (the ``kernels`` package's layer classes are keyed by it); it has the
    replacement's name and signature."""
    if replacement in _guarded_forwards:
        return _guarded_forwards[replacement]

    @functools.wraps(replacement)
    def forward(self: Any, *args: Any, **kwargs: Any) -> object:
        rec = self.__dict__[RECORDS]["forward"]
        guard = rec.guard
        if control.adopted_layers_active(guard.op):
            why = guard.why_not(self, args, kwargs)
            if not why:
                return replacement(self, *args, **kwargs)
            guard.warn(why)
        if rec.had_original:  # a forward set on the instance before adoption
            return rec.original(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    _guarded_forwards[replacement] = forward
    return forward


class GuardedFunction:
    """A replacement installed as a plain attribute (a model's ``_loss_function``): the
    replacement while torchgraft runs ``op``, else ``own``.

    Copies (``copy.deepcopy``) are guarded functions too; a pickle stores ``own`` (the function
    the model had), so an unpickled model is a plain one.
    """

    def __init__(
        self, replacement: Callable[..., object], own: Callable[..., object], op: str
    ) -> None:
        self.replacement = replacement
        self.own = own
        self.op = op
        functools.update_wrapper(self, replacement)

    def __call__(self, *args: Any, **kwargs: Any) -> object:
        if control.adopted_layers_active(self.op):
            return self.replacement(*args, **kwargs)
        return self.own(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        # Unpickled as the model's own function: ``copy.copy`` of that is the function itself.
        return copy.copy, (self.own,)

    def __copy__(self) -> GuardedFunction:
        return GuardedFunction(self.replacement, self.own, self.op)

    def __deepcopy__(self, memo: dict[int, object]) -> GuardedFunction:
        return self.__copy__()


@functools.cache
def sharded_subclass(cls: type, verified: type) -> bool:
    """Whether ``cls`` is the class FSDP2's ``fully_shard`` gives a module of class ``verified``
    (``FSDP<name>``: FSDPModule's methods, ``verified``'s forward and everything else)."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return (
        fsdp_module is not None
        and cls.__bases__ == (fsdp_module, verified)
        and cls.forward is getattr(verified, "forward", None)
    )


def global_hooks() -> str:
    """Which global module hooks (``torch.nn.modules.module.register_module_*_hook``) are set:
    they run around every module call, the children a replacement bypasses included."""
    m = _torch_module
    if m._global_forward_pre_hooks or m._global_forward_hooks:
        return "global module forward hooks are set"
    if m._global_backward_pre_hooks or m._global_backward_hooks:
        return "global module backward hooks are set"
    return ""


@dataclass(frozen=True)
class Child:
    """A child module a replacement does not call (it computes what the child computes): its
    class and public settings when verified (``GELU.approximate``, ``GELUTanh.act``...)."""

    name: str
    cls: type
    settings: tuple[tuple[str, object], ...]


def child(module: torch.nn.Module, name: str) -> Child:
    """Snapshot of ``module``'s child ``name`` (see :class:`Child`)."""
    c = module._modules[name]
    assert c is not None
    settings = tuple(
        (k, v)
        for k, v in vars(c).items()
        if not k.startswith("_") and k != "training" and (isinstance(v, _PLAIN) or callable(v))
    )
    return Child(name, type(c), settings)


_PLAIN = (str, int, float, bool, type(None))


def child_changed(module: torch.nn.Module, snap: Child) -> str:
    """Why the child ``snap`` describes no longer computes what was verified, or runs code the
    replacement would skip (hooks, a ``forward`` set on the instance); empty if neither."""
    c = module._modules.get(snap.name)
    if type(c) is not snap.cls:
        now, was = _names(type(c), snap.cls)
        return f"{snap.name} is now {now}, not {was}"
    assert c is not None
    if c._forward_hooks or c._forward_pre_hooks:
        return f"{snap.name} has forward hooks"
    if c._backward_hooks or c._backward_pre_hooks:
        return f"{snap.name} has backward hooks"
    if "forward" in c.__dict__:
        return f"{snap.name}.forward is set on the instance"
    own = c.__dict__
    for key, value in snap.settings:
        now = own.get(key)
        if now is not value and not (isinstance(now, _PLAIN) and now == value):
            return f"{snap.name}.{key} changed from {value!r} to {now!r}"
    return ""


def _names(now: type, was: type) -> tuple[str, str]:
    """The two classes' names, qualified where the short ones coincide (peft's ``Linear``)."""
    if now.__name__ != was.__name__:
        return now.__name__, was.__name__
    return f"{now.__module__}.{now.__qualname__}", f"{was.__module__}.{was.__qualname__}"
