"""What every DSL helper shares: finding the DSL without importing it, gates, registration."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from torch._vendor.packaging.version import InvalidVersion, Version

from .. import registry
from ..registry import env

_MISSING: Any = object()


@functools.cache
def find_module(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it or its parents.

    Cached for the process, like torch._native's checks: installing a DSL needs a restart.

    ``importlib.util.find_spec("cuda.tile")`` would import ``cuda`` first; here a dotted name
    is searched for along its parent's path (the parent's ``__path__`` if it is already
    imported, else every ``<sys.path entry>/<parent>`` directory, as for namespace packages).
    """
    head, _, rest = module.partition(".")
    if head in sys.modules and not rest:
        return True
    if not rest:
        try:
            return importlib.util.find_spec(head) is not None
        except (ImportError, ValueError):
            return False
    paths: list[str]
    parent = sys.modules.get(head)
    if parent is not None:
        paths = list(getattr(parent, "__path__", []))
    else:
        if importlib.machinery.PathFinder.find_spec(head) is None:
            return False
        paths = [os.path.join(entry or ".", head) for entry in sys.path]
        paths = [p for p in paths if os.path.isdir(p)]
    for part in rest.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, paths)
        if spec is None:
            return False
        paths = list(spec.submodule_search_locations or [])
    return True


@functools.cache
def package_version(package: str) -> Version | None:
    """The installed version of distribution ``package`` from its metadata (no import).

    Cached for the process (reading metadata scans sys.path).
    """
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


class DSLRuntime:
    """One DSL: where to find it, how old it may be, and its registration helpers."""

    def __init__(
        self,
        name: str,
        *,
        package: str,
        module: str,
        min_version: str | None,
        other_packages: tuple[str, ...] = (),
        version_fn: Callable[[], Version | None] | None = None,
        compat_fn: Callable[[Version], str | None] | None = None,
    ) -> None:
        self.name = name
        self.package = package
        #: Other distributions that provide the same module (e.g. nightly ``pytorch-triton``).
        self.other_packages = other_packages
        self.module = module
        self.min_version = Version(min_version) if min_version is not None else None
        self._version_fn = version_fn
        #: Given the installed version, why it cannot work here (e.g. with this torch), or None.
        self._compat_fn = compat_fn
        self.log = logging.getLogger(f"torchgraft.dsl.{name}")

    def runtime_available(self) -> bool:
        """Whether the DSL's module can be imported (checked without importing it)."""
        return find_module(self.module)

    def runtime_version(self) -> Version | None:
        """The installed DSL version from package metadata, or None when not installed."""
        if not self.runtime_available():
            return None
        if self._version_fn is not None:
            return self._version_fn()
        for package in (self.package, *self.other_packages):
            version = package_version(package)
            if version is not None:
                return version
        return None

    def unusable_reason(self) -> str | None:
        """Why overrides of this DSL would not be registered now, or None when they would."""
        if env.env_flag(env.TORCH_DISABLE_NATIVE_JIT_ENV):
            return f"{env.TORCH_DISABLE_NATIVE_JIT_ENV}=1 disables DSL-based overrides"
        if not self.runtime_available():
            return f"{self.name} is not installed (module {self.module!r} not found)"
        if self.min_version is None or env.env_flag(env.SKIP_VERSION_CHECK_ENV):
            return None
        version = self.runtime_version()
        if version is None:
            return (
                f"{self.name}'s version is unknown (no metadata for package {self.package!r}); "
                f"set {env.SKIP_VERSION_CHECK_ENV}=1 to register anyway"
            )
        if version < self.min_version:
            return (
                f"{self.name} {version} is older than the required {self.min_version}; "
                f"set {env.SKIP_VERSION_CHECK_ENV}=1 to register anyway"
            )
        if self._compat_fn is not None:
            reason = self._compat_fn(version)
            if reason is not None:
                return f"{reason}; set {env.SKIP_VERSION_CHECK_ENV}=1 to register anyway"
        return None

    def register_op_override(
        self,
        lib_symbol: str,
        op_symbol: str,
        dispatch_key: str,
        *cond_and_impl: Callable[..., Any] | None,
        cond: Callable[..., bool] | None = _MISSING,
        impl: Callable[..., Any] = _MISSING,
        allow_multiple_override: bool = False,
        unconditional_override: bool = False,
    ) -> registry.OverrideInfo | None:
        """Register an override written in this DSL, unless the DSL is missing or too old.

        Two forms are accepted:

        * torch 2.13: ``(lib, op, key, cond, impl)``; ``impl(*args)``; ``cond=None`` needs
          ``unconditional_override=True``;
        * older (torch 2.12, the seeds): ``(lib, op, key, impl)`` with no cond; with
          ``unconditional_override=False`` the impl receives the DispatchKeySet first and takes
          every call (calling the op again inside it reaches the previous kernel); with True it
          is called as ``impl(*args)`` for every call.

        Returns the registered override, or None when it was skipped (logged at INFO).
        """
        positional = list(cond_and_impl)
        if len(positional) > 2:
            raise TypeError(
                "register_op_override takes (lib, op, key, cond, impl) or (lib, op, key, impl)"
            )
        if impl is _MISSING:
            if not positional:
                raise TypeError("register_op_override() missing its impl")
            impl = positional.pop()
        if positional:
            if cond is not _MISSING:
                raise TypeError("register_op_override() got cond twice")
            cond = positional.pop()
        older_form = cond is _MISSING
        reason = self.unusable_reason()
        if reason is not None:
            self.log.info(
                "skipping the %s override of aten::%s at %s: %s",
                self.name,
                op_symbol,
                dispatch_key,
                reason,
            )
            return None
        return registry.register_op_override(
            self.name,
            lib_symbol,
            op_symbol,
            dispatch_key,
            None if older_form else cond,
            impl,
            unconditional_override=unconditional_override,
            allow_multiple_override=allow_multiple_override,
            with_keyset=older_form and not unconditional_override,
        )

    def deregister_op_overrides(self) -> None:
        """Switch off every override of this DSL (until :meth:`reenable_op_overrides`)."""
        registry.deregister_op_overrides(disable_dsl_names=self.name)

    def reenable_op_overrides(self) -> None:
        """Switch this DSL's overrides back on."""
        registry.reenable_op_overrides(enable_dsl_names=self.name)
