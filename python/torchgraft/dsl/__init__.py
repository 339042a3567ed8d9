"""Per-DSL override helpers: ``torchgraft.dsl.<name>.register_op_override(...)``.

Each of :mod:`.triton`, :mod:`.cutedsl`, :mod:`.helion`, :mod:`.cutile` and :mod:`.native` has
``runtime_available()``, ``runtime_version()``, ``register_op_override(...)`` (torch 2.13's form
and the older keyset-first form of the seeds), ``deregister_op_overrides()`` and
``reenable_op_overrides()``. None of them imports its DSL.
"""

from __future__ import annotations

from types import ModuleType

from . import cutedsl, cutile, helion, native, triton

#: DSL name -> its helper module.
DSLS: dict[str, ModuleType] = {m.NAME: m for m in (triton, cutedsl, helion, cutile, native)}


def dsl_versions() -> dict[str, str | None]:
    """Each DSL's installed version as a string (None when it is not installed)."""
    result: dict[str, str | None] = {}
    for name, module in DSLS.items():
        version = module.runtime_version()
        result[name] = str(version) if version is not None else None
    return result


__all__ = ["DSLS", "cutedsl", "cutile", "dsl_versions", "helion", "native", "triton"]
