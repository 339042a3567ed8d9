"""Where replacements are installed, and how the originals come back.

Two kinds of slot:

- An attribute in one object's own ``__dict__``: a module's ``forward`` (a method bound to that
  module, exactly as the ``kernels`` package installs one) or a transformers model's
  ``_loss_function``. Its record lives on the object itself, so it follows the object through
  ``copy.deepcopy`` and ``.to()``; ``state_dict``, parameters, buffers and hooks are untouched.
- A module-global function (transformers' ``apply_rotary_pos_emb``): shared by every model of
  that family in the process, so it is replaced while at least one adopted model holds it and put
  back when the last one is unadopted or garbage collected. The hold belongs to the model's
  records object (weakly referenced), so a deep copy of the model, which copies its records,
  holds it too, and releasing one leaves the other whole.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchgraft.adopt.report import AdoptionRow

if TYPE_CHECKING:
    from torchgraft.adopt.guard import Guard

RECORDS = "_torchgraft_adoption"
"""The attribute (in the owner's ``__dict__``) holding its records: ``{slot name: record}``."""


@dataclass
class Record:
    """What was in an attribute slot before adoption, and what was installed."""

    attr: str
    had_original: bool
    """Whether the owner's own ``__dict__`` held the attribute before (a method patched by someone
    else, or kernels); otherwise the class's attribute showed through and will again."""
    original: object
    installed: Callable[..., object]
    """The installed function (for ``forward``, the function bound to the module)."""
    row: AdoptionRow
    guard: Guard | None = None
    """What the installed function re-checks on each call (:mod:`torchgraft.adopt.guard`)."""


class _Records(dict):  # type: ignore[type-arg]
    """An owner's records. Copies (``copy.deepcopy``) keep them, and a copy holds the
    module-global replacements the original holds; pickles drop them: the installed functions
    are closures, a pickled module's bound ``forward`` comes back as its class's (``MethodType``
    pickles by name) and a replaced loss function as the model's own, so an unpickled model is a
    plain, unadopted one."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return dict, ()

    def __copy__(self) -> _Records:
        return _Records(self)

    def __deepcopy__(self, memo: dict[int, object]) -> _Records:
        new = _Records()
        memo[id(self)] = new
        for k, v in self.items():
            if isinstance(v, GlobalRecord) and not _hold(new, v.key):
                continue  # released meanwhile: the copy holds nothing there either
            new[k] = copy.deepcopy(v, memo)
        return new


def _own_records(owner: object) -> _Records:
    """The owner's records, created where absent (an unpickled model has a plain empty dict)."""
    recs = vars(owner).get(RECORDS)
    if not isinstance(recs, _Records):
        recs = vars(owner)[RECORDS] = _Records(recs or {})
    return recs


def records(owner: object) -> dict[str, object]:
    """The owner's adoption records (empty when nothing of it is adopted)."""
    return vars(owner).get(RECORDS, {})


def is_installed(owner: object, attr: str) -> bool:
    """Whether the function recorded for ``owner.attr`` is still the one in place."""
    rec = records(owner).get(attr)
    return isinstance(rec, Record) and _holds(owner, rec)


def _holds(owner: object, rec: Record) -> bool:
    current = vars(owner).get(rec.attr)
    if isinstance(current, types.MethodType):
        return current.__func__ is rec.installed and current.__self__ is owner
    return current is rec.installed


def remember(
    owner: object,
    attr: str,
    installed: Callable[..., object],
    row: AdoptionRow,
    guard: Guard | None = None,
) -> None:
    """Record what ``owner.attr`` is now, before something installs ``installed`` there."""
    own = vars(owner)
    _own_records(owner)[attr] = Record(attr, attr in own, own.get(attr), installed, row, guard)


def install(
    owner: object,
    attr: str,
    function: Callable[..., object],
    row: AdoptionRow,
    bind: bool,
    guard: Guard | None = None,
) -> None:
    """Put ``function`` (bound to ``owner`` when ``bind``) in ``owner.attr``, remembering what was
    there."""
    remember(owner, attr, function, row, guard)
    vars(owner)[attr] = types.MethodType(function, owner) if bind else function


def forget(owner: object, attr: str) -> None:
    """Drop the record of ``owner.attr`` without touching the slot (an install that did not
    happen)."""
    own = records(owner)
    own.pop(attr, None)
    if not own:
        vars(owner).pop(RECORDS, None)


def restore(owner: object, attr: str, force: bool = False) -> bool:
    """Put back what ``owner.attr`` was before adoption and drop the record.

    Returns False (and changes nothing) when something else has replaced the installed function
    since: that newer function is left in place, unless ``force`` (undoing a failed install).
    """
    rec = records(owner).get(attr)
    if not isinstance(rec, Record):
        return False
    restored = force or _holds(owner, rec)
    if restored:
        if rec.had_original:
            vars(owner)[attr] = rec.original
        else:
            vars(owner).pop(attr, None)
    forget(owner, attr)
    return restored


@dataclass
class _GlobalPatch:
    original: object
    replacement: Callable[..., object]
    holders: dict[int, weakref.ref[object]] = field(default_factory=dict)
    """The records objects (:class:`_Records`) of the models holding it, by id."""


_globals: dict[tuple[str, str], _GlobalPatch] = {}
# Reentrant: a holder collected while the lock is held calls back into _drop on this thread.
_globals_lock = threading.RLock()


def hold_global(
    holder: object,
    module: types.ModuleType,
    name: str,
    replacement: Callable[..., object],
    row: AdoptionRow,
) -> str:
    """Replace ``module.name`` by ``replacement`` (if not already) on behalf of ``holder``.

    Returns why not (empty when held): a function someone else put at ``module.name`` after the
    first adoption is never overwritten.
    """
    key = (module.__name__, name)
    with _globals_lock:
        current = getattr(module, name)
        patch = _globals.get(key)
        if patch is None:
            patch = _GlobalPatch(current, replacement)
            _globals[key] = patch
        elif current is not patch.replacement and current is not patch.original:
            return (
                f"{key[0]}.{name} was replaced by {getattr(current, '__qualname__', current)} "
                "after adoption: left in place"
            )
        # Installed again where the original was put back meanwhile (a benchmark that installs
        # the replacement only around one model's steps, say).
        setattr(module, name, patch.replacement)
        recs = _own_records(holder)
        _hold(recs, key)
        recs[_global_record(module, name)] = GlobalRecord(key, row)
    return ""


def _hold(recs: _Records, key: tuple[str, str]) -> bool:
    """Register ``recs`` (a model's records) as a holder of the patch at ``key``; released when
    the model is unadopted, or when its records are garbage collected. False if no patch is
    there any more."""
    with _globals_lock:
        patch = _globals.get(key)
        if patch is None:
            return False
        patch.holders[id(recs)] = weakref.ref(recs, functools.partial(_dropped, key, id(recs)))
        return True


@dataclass
class GlobalRecord:
    """A model's hold on a replaced module-global function."""

    key: tuple[str, str]
    row: AdoptionRow


def _global_record(module: types.ModuleType, name: str) -> str:
    return f"global:{module.__name__}.{name}"


def holds_global(holder: object, module: types.ModuleType, name: str) -> bool:
    """Whether ``holder`` holds the replacement of ``module.name``."""
    recs = records(holder)
    rec = recs.get(_global_record(module, name))
    patch = _globals.get((module.__name__, name))
    return isinstance(rec, GlobalRecord) and patch is not None and id(recs) in patch.holders


def held_global(module: types.ModuleType, name: str) -> tuple[object, Callable[..., object]] | None:
    """``(original, replacement)`` where some adopted model holds a replacement of
    ``module.name``, else ``None``."""
    patch = _globals.get((module.__name__, name))
    return (patch.original, patch.replacement) if patch is not None else None


def release_global(holder: object, record_name: str) -> bool:
    """Drop ``holder``'s hold; the original function comes back when no holder is left.
    Returns whether ``holder`` held it."""
    recs = records(holder)
    rec = recs.get(record_name)
    if not isinstance(rec, GlobalRecord):
        return False
    forget(holder, record_name)
    return _drop(rec.key, id(recs))


def _dropped(key: tuple[str, str], holder_id: int, _: object) -> None:
    _drop(key, holder_id)


def _drop(key: tuple[str, str], holder_id: int) -> bool:
    with _globals_lock:
        patch = _globals.get(key)
        if patch is None or patch.holders.pop(holder_id, None) is None:
            return False
        if not patch.holders:
            del _globals[key]
            module = sys.modules.get(key[0])
            if module is not None and getattr(module, key[1], None) is patch.replacement:
                setattr(module, key[1], patch.original)
        return True
