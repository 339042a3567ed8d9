"""Overrides written in Helion.

Availability and version come from the import system and package metadata; helion is never
imported here. Registration is skipped, with an INFO log on ``torchgraft.dsl.helion``, when it
is missing, older than 1.0 (``TORCHGRAFT_SKIP_VERSION_CHECK=1`` skips the gate) or
``TORCH_DISABLE_NATIVE_JIT=1`` is set.
"""

from __future__ import annotations

from ._runtime import DSLRuntime

NAME = "helion"
#: Distribution name on PyPI and the module it provides.
PACKAGE = "helion"
MODULE = "helion"
MIN_VERSION = "1.0"

runtime = DSLRuntime(NAME, package=PACKAGE, module=MODULE, min_version=MIN_VERSION)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
