"""Per-DSL override helpers: ``torchgraft.dsl.<name>.register_op_override(...)``.

Each of :mod:`.triton`, :mod:`.cutedsl`, :mod:`.helion`, :mod:`.cutile` and ``native``
(:mod:`.extension`: overrides whose impl calls torchgraft's compiled extension) has
``runtime_available()``, ``runtime_version()``, ``register_op_override(...)`` (torch 2.13's form
and the older keyset-first form of the seeds), ``deregister_op_overrides()`` and
``reenable_op_overrides()``. None of them imports its DSL.
"""

from __future__ import annotations

from types import ModuleType

from . import cutedsl, cutile, extension, helion, triton

#: The ``"native"`` DSL's helpers under their documented name, ``torchgraft.dsl.native``.
native = extension

#: DSL name -> its helper module.
DSLS: dict[str, ModuleType] = {m.NAME: m for m in (triton, cutedsl, helion, cutile, extension)}


def dsl_versions() -> dict[str, str | None]:
    """Each DSL's installed version as a string (None when it is not installed)."""
    result: dict[str, str | None] = {}
    for name, module in DSLS.items():
        version = module.runtime_version()
        result[name] = str(version) if version is not None else None
    return result


__all__ = ["DSLS", "cutedsl", "cutile", "dsl_versions", "extension", "helion", "native", "triton"]
