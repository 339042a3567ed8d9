"""Overrides written in CuTeDSL (the nvidia-cutlass-dsl package, module ``cutlass``).

Availability and version come from the import system and package metadata; the DSL is never
imported here. Registration is skipped, with an INFO log on ``torchgraft.dsl.cutedsl``, when it
is missing, older than 4.4.1 (``TORCHGRAFT_SKIP_VERSION_CHECK=1`` skips the gate) or
``TORCH_DISABLE_NATIVE_JIT=1`` is set.

torchgraft's CuteDSL kernels come from kernel libraries written in it (:data:`LIBRARIES`):
FlashAttention-4 and quack. :func:`library_unusable_reason` checks one of them the same way,
without importing it; :func:`register_library_overrides` installs an op package's overrides
that call one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch._vendor.packaging.version import Version

from ..registry import env
from ._runtime import DSLRuntime, find_module, package_version

if TYPE_CHECKING:
    from ..registry import OverrideInfo

NAME = "cutedsl"
#: Distribution name on PyPI and the module it provides.
PACKAGE = "nvidia-cutlass-dsl"
MODULE = "cutlass"
MIN_VERSION = "4.4.1"

runtime = DSLRuntime(NAME, package=PACKAGE, module=MODULE, min_version=MIN_VERSION)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides


@dataclass(frozen=True)
class Library:
    """A kernel library written in CuteDSL that an op package calls."""

    package: str
    """Distribution name on PyPI."""
    module: str
    """The module the op package imports (on first call)."""
    min_version: str
    below_version: str | None
    """First version not accepted (the op package calls interfaces that may change), or None."""
    needs: tuple[str, ...] = ()
    """Other modules it imports at load time (found without importing them)."""


#: Library name -> what it takes. Versions are the ones the op packages were written against:
#: flash-attn-4 4.0.0b36 (its ``_flash_attn_fwd`` / ``_flash_attn_bwd``, which torch 2.13's
#: own FA4 integration calls too) and quack-kernels 0.6.5 (``rmsnorm_fwd`` / ``rmsnorm_bwd``).
LIBRARIES: dict[str, Library] = {
    "flash-attn-4": Library("flash-attn-4", "flash_attn.cute", "4.0.0b36", "5", ("tvm_ffi",)),
    "quack-kernels": Library("quack-kernels", "quack", "0.6.5", "0.7", ("tvm_ffi",)),
}


def library_version(name: str) -> Version | None:
    """The installed version of library ``name`` (a key of :data:`LIBRARIES`), or None."""
    library = LIBRARIES[name]
    return package_version(library.package) if find_module(library.module) else None


def library_unusable_reason(name: str) -> str | None:
    """Why overrides that call library ``name`` would not be registered now, or None.

    The DSL's own reasons come first (missing, too old, ``TORCH_DISABLE_NATIVE_JIT=1``); then
    the library must be installed, with the modules it needs, in the accepted version range
    (``TORCHGRAFT_SKIP_VERSION_CHECK=1`` accepts any version).
    """
    reason = runtime.unusable_reason()
    if reason is not None:
        return reason
    library = LIBRARIES[name]
    if not find_module(library.module):
        return f"{name} is not installed (module {library.module!r} not found)"
    missing = [module for module in library.needs if not find_module(module)]
    if missing:
        return f"{name} needs module(s) {', '.join(missing)}, which are not installed"
    if env.env_flag(env.SKIP_VERSION_CHECK_ENV):
        return None
    version = package_version(library.package)
    if version is None:
        return (
            f"{name}'s version is unknown (no metadata for package {library.package!r}); "
            f"set {env.SKIP_VERSION_CHECK_ENV}=1 to register anyway"
        )
    low, high = Version(library.min_version), library.below_version
    if version < low or (high is not None and version >= Version(high)):
        accepted = f">= {low}" + (f", < {high}" if high is not None else "")
        return (
            f"{name} {version} is outside the accepted versions ({accepted}); "
            f"set {env.SKIP_VERSION_CHECK_ENV}=1 to register anyway"
        )
    return None


#: ``(op_symbol, cond, impl)``: one conditional override of ``aten::<op_symbol>`` at CUDA.
OverrideRow = tuple[str, Callable[..., Any], Callable[..., Any]]


def register_library_overrides(
    library: str,
    rows: Callable[[], Iterable[OverrideRow]],
    registered: list[OverrideInfo],
    what: str,
) -> None:
    """Install the conditional overrides ``rows()`` lists, whose impls call library ``library``
    (a key of :data:`LIBRARIES`), at CUDA; append what was installed to ``registered``.

    Idempotent: nothing is installed while an override in ``registered`` is still live (entries
    removed since, e.g. by ``registry.clear_overrides()``, are dropped first). When the library
    cannot be used, nothing is installed and an INFO log says ``"<what> not registered: <why>"``.
    ``rows`` is called only then, so the op package's conds and impls are imported only then.
    """
    from .. import registry

    live = {o.node_id for o in registry.list_overrides()}
    registered[:] = [info for info in registered if info.node_id in live]
    if registered:
        return
    reason = library_unusable_reason(library)
    if reason is not None:
        logging.getLogger(f"torchgraft.dsl.{NAME}").info("%s not registered: %s", what, reason)
        return
    for op_symbol, cond, impl in rows():
        info = register_op_override("aten", op_symbol, "CUDA", cond, impl)
        if info is not None:
            registered.append(info)
