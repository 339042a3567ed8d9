"""Overrides whose impl calls torchgraft's own compiled extension (``torchgraft._native``).

The DSL's name is ``"native"`` (as in ``register_op_override("native", ...)`` and
``torchgraft.dsl.native``); this module is named for what it holds, so "native" in a module name
means the native route (:mod:`torchgraft.native`) only.

Available when the extension module can be found (it is not imported here); its version is
torchgraft's own (the distribution's metadata), so there is no version gate.
``TORCH_DISABLE_NATIVE_JIT=1`` skips these registrations like the other DSLs'.
"""

from __future__ import annotations

from ._runtime import DSLRuntime

NAME = "native"
PACKAGE = "torchgraft"
MODULE = "torchgraft._native"
MIN_VERSION = None

runtime = DSLRuntime(NAME, package=PACKAGE, module=MODULE, min_version=MIN_VERSION)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
