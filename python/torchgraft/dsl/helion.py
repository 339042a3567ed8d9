"""Overrides written in Helion.

Availability and version come from the import system and package metadata; helion is never
imported here. Registration is skipped, with an INFO log on ``torchgraft.dsl.helion``, when it
is missing, older than 1.0, too new for the installed torch (:data:`TORCH_FLOOR`)
(``TORCHGRAFT_SKIP_VERSION_CHECK=1`` skips both gates) or ``TORCH_DISABLE_NATIVE_JIT=1`` is set.
"""

from __future__ import annotations

import torch
from torch._vendor.packaging.version import Version

from ._runtime import DSLRuntime

NAME = "helion"
#: Distribution name on PyPI and the module it provides.
PACKAGE = "helion"
MODULE = "helion"
MIN_VERSION = "1.0"

#: ``(first helion release, oldest torch it imports with)``, newest first. Helion follows
#: torch's private modules closely: helion 1.5.1 imports ``IntelGPUError`` from
#: ``torch._inductor.runtime.triton_compat``, which torch 2.11 lacks (seen on the H100:
#: ``import helion`` fails), while helion 1.4.0 and 1.2.0 import and run on torch 2.11.
#: Helion 1.5.x with torch 2.12 has not been tried, so the floor is the first torch known to
#: have that name (2.13). Releases older than every row work with torch >= 2.11.
TORCH_FLOOR: tuple[tuple[str, str], ...] = (("1.5", "2.13"),)


def torch_release(version: str | None = None) -> Version:
    """``"2.11.0+cu130"`` -> ``Version("2.11.0")`` (the installed torch's when None); nightlies
    (``2.13.0.dev2026...``) count as their release."""
    return Version(Version(torch.__version__ if version is None else version).base_version)


def torch_compat_reason(
    helion_version: Version, torch_version: Version | None = None
) -> str | None:
    """Why ``helion_version`` cannot run with ``torch_version`` (the installed torch by default),
    or None when the pair is known to work (see :data:`TORCH_FLOOR`)."""
    torch_version = torch_release() if torch_version is None else torch_version
    for first_helion, oldest_torch in TORCH_FLOOR:
        if helion_version >= Version(first_helion):
            if torch_version < Version(oldest_torch):
                return (
                    f"helion {helion_version} needs torch >= {oldest_torch} (torch "
                    f"{torch_version} is installed); helion 1.4.0 works with torch 2.11 and 2.12"
                )
            return None
    return None


runtime = DSLRuntime(
    NAME,
    package=PACKAGE,
    module=MODULE,
    min_version=MIN_VERSION,
    compat_fn=torch_compat_reason,
)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
