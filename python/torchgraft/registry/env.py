"""Environment variables that steer the registry, read when they are needed (not at import)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

#: ``TORCHGRAFT_DISABLE=1``: every torchgraft override registration becomes a no-op.
DISABLE_ENV = "TORCHGRAFT_DISABLE"
#: ``TORCHGRAFT_OVERRIDE_ORDER_FN=package.module.fn``: a user ordering function.
ORDER_FN_ENV = "TORCHGRAFT_OVERRIDE_ORDER_FN"
#: ``TORCHGRAFT_SKIP_VERSION_CHECK=1``: DSL version gates pass whatever the version.
SKIP_VERSION_CHECK_ENV = "TORCHGRAFT_SKIP_VERSION_CHECK"
#: torch's own switch for DSL-based native ops; torchgraft's DSL helpers honour it too.
TORCH_DISABLE_NATIVE_JIT_ENV = "TORCH_DISABLE_NATIVE_JIT"
#: ``TORCHGRAFT_STRICT=1``: routers installed from then on check every impl result against the
#: op's meta and compare its values with the kernel below (see ``outputs.py``).
STRICT_ENV = "TORCHGRAFT_STRICT"

_TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str) -> bool:
    """True when the environment variable ``name`` is set to 1/true/yes/on (any case)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def kill_switch_set() -> bool:
    """True when ``TORCHGRAFT_DISABLE`` turns every torchgraft override off."""
    return env_flag(DISABLE_ENV)


def strict_mode() -> bool:
    """True when ``TORCHGRAFT_STRICT`` asks routers to check and shadow-verify every call."""
    return env_flag(STRICT_ENV)


_resolved: dict[str, Callable[..., Any]] = {}


def env_order_fn() -> Callable[..., Any] | None:
    """The ordering function named by ``TORCHGRAFT_OVERRIDE_ORDER_FN``, or None when unset.

    Raises:
        ValueError: the variable does not name an importable callable.
    """
    spec = os.environ.get(ORDER_FN_ENV, "").strip()
    if not spec:
        return None
    fn = _resolved.get(spec)
    if fn is not None:
        return fn
    # "Could not resolve" is the wording torch._native uses for its own variable.
    module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"Could not resolve {ORDER_FN_ENV}={spec!r}: it must have the form "
            "'package.module.function'"
        )
    try:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"Could not resolve {ORDER_FN_ENV}={spec!r} into an importable function: {exc}"
        ) from exc
    if not callable(fn):
        raise ValueError(
            f"Could not resolve {ORDER_FN_ENV}={spec!r} into a callable: it names "
            f"{type(fn).__name__}, not a function"
        )
    _resolved[spec] = fn
    return fn
