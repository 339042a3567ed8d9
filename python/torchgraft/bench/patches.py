"""Monkey patches caught, undone, and applied only while their owner runs.

Some libraries speed a model up by assigning to module and class attributes (Liger-Kernel's
``apply_liger_kernel_to_llama`` replaces ``modeling_llama.apply_rotary_pos_emb``, the RMSNorm
and MLP classes, and ``torch.nn.functional.cross_entropy``, even when given one model
instance). Such patches reach every model in the process. To compare variants side by side,
:func:`record` runs the patching function, notes every attribute it changed in the watched
namespaces, and puts the old values back; :func:`applied` installs the noted values again for
the duration of a ``with`` block, so only the variant that owns them runs with them.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["Patch", "Snapshot", "applied", "namespaces_for", "record", "where"]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""The value of an attribute that does not exist."""


@dataclass(frozen=True)
class Patch:
    """One attribute of a module or class that a patching function changed."""

    target: Any
    name: str
    old: Any
    """The value before (``MISSING`` if the attribute did not exist)."""
    new: Any
    """The value after (``MISSING`` if the function deleted it)."""


def where(patch: Patch) -> str:
    """``module.attribute`` or ``module.Class.attribute``, for reports."""
    target = patch.target
    if isinstance(target, ModuleType):
        return f"{target.__name__}.{patch.name}"
    return f"{target.__module__}.{target.__qualname__}.{patch.name}"


def _set(target: Any, name: str, value: Any) -> None:
    if value is MISSING:
        if name in vars(target):
            delattr(target, name)
    else:
        setattr(target, name, value)


# Globals torch.compile installs in the module of the code it compiled (compiled graphs, resume
# functions, builtins and imports they reference): dynamo's bookkeeping, not a patch.
_DYNAMO_GLOBALS = ("__compiled_fn_", "__resume_at_", "__builtins_dict__", "__import_")


class Snapshot:
    """The attribute dicts of some modules and classes at one moment."""

    def __init__(self, targets: Iterable[Any]) -> None:
        self.targets = list({id(t): t for t in targets}.values())
        self.values = {id(t): dict(vars(t)) for t in self.targets}

    def changes(self) -> list[Patch]:
        """Every attribute that differs now (by identity), as patches from then to now.

        A submodule that appeared (``import pkg.sub`` binds ``sub`` on ``pkg``) is an import,
        not a patch, and is left out, as are torch.compile's own globals."""
        patches = []
        for target in self.targets:
            before, now = self.values[id(target)], dict(vars(target))
            for name in sorted(before.keys() | now.keys()):
                old, new = before.get(name, MISSING), now.get(name, MISSING)
                if old is new or (old is MISSING and isinstance(new, ModuleType)):
                    continue
                if old is MISSING and name.startswith(_DYNAMO_GLOBALS):
                    continue
                patches.append(Patch(target, name, old, new))
        return patches


def record(targets: Sequence[Any], patch_fn: Callable[[], object]) -> list[Patch]:
    """Runs ``patch_fn()``, then undoes what it changed in ``targets`` and returns it.

    Attributes it changes outside ``targets`` are not seen (choose them with
    :func:`namespaces_for`); changes to objects (a model instance) stay, as they belong to it.
    """
    snapshot = Snapshot(targets)
    try:
        patch_fn()
    finally:
        patches = snapshot.changes()
        for patch in reversed(patches):
            _set(patch.target, patch.name, patch.old)
    return patches


@contextlib.contextmanager
def applied(patches: Sequence[Patch]) -> Iterator[None]:
    """Installs ``patches`` for the ``with`` block and restores the old values after it."""
    for patch in patches:
        _set(patch.target, patch.name, patch.new)
    try:
        yield
    finally:
        for patch in reversed(patches):
            _set(patch.target, patch.name, patch.old)


def namespaces_for(module_names: Iterable[str]) -> list[Any]:
    """The modules named (those imported) and every class they define: what model-patching
    libraries assign to."""
    targets: list[Any] = []
    for name in module_names:
        module = sys.modules.get(name)
        if module is None:
            continue
        targets.append(module)
        targets.extend(
            value
            for value in vars(module).values()
            if inspect.isclass(value) and value.__module__ == module.__name__
        )
    return targets
