"""Overrides whose impl calls torchgraft's own Rust extension (``torchgraft._native``).

Available when the extension module can be found (it is not imported here); its version is
torchgraft's own, so there is no version gate. ``TORCH_DISABLE_NATIVE_JIT=1`` skips these
registrations like the other DSLs'.
"""

from __future__ import annotations

from torch._vendor.packaging.version import InvalidVersion, Version

from ._runtime import DSLRuntime, package_version

NAME = "native"
PACKAGE = "torchgraft"
MODULE = "torchgraft._native"
MIN_VERSION = None


def _torchgraft_version() -> Version | None:
    version = package_version(PACKAGE)
    if version is not None:
        return version
    import torchgraft  # already imported: this module lives in it

    text = getattr(torchgraft, "__version__", None)
    try:
        return Version(text) if isinstance(text, str) else None
    except InvalidVersion:
        return None


runtime = DSLRuntime(
    NAME,
    package=PACKAGE,
    module=MODULE,
    min_version=MIN_VERSION,
    version_fn=_torchgraft_version,
)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
