"""Overrides written in Triton.

Availability and version come from the import system and package metadata; triton is never
imported here. Registration is skipped, with an INFO log on ``torchgraft.dsl.triton``, when it
is missing, older than 3.6 (``TORCHGRAFT_SKIP_VERSION_CHECK=1`` skips the gate) or
``TORCH_DISABLE_NATIVE_JIT=1`` is set.
"""

from __future__ import annotations

from ._runtime import DSLRuntime

NAME = "triton"
#: Distribution name on PyPI and the module it provides.
PACKAGE = "triton"
MODULE = "triton"
MIN_VERSION = "3.6"
#: PyTorch's nightly wheels ship Triton under this distribution name.
OTHER_PACKAGES = ("pytorch-triton",)

runtime = DSLRuntime(
    NAME, package=PACKAGE, module=MODULE, min_version=MIN_VERSION, other_packages=OTHER_PACKAGES
)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
