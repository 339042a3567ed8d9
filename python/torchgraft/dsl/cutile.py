"""Overrides written in cuTile Python (the cuda-tile package, module ``cuda.tile``).

Availability and version come from the import system and package metadata; cuda-tile is never
imported here. cuTile compiles through NVIDIA's ``tileiras`` compiler, which is not part of
cuda-tile: it comes from the ``nvidia-cuda-tileiras`` wheel (``pip install cuda-tile[tileiras]``)
or a CUDA toolkit >= 13.1, and compiles for Hopper (sm90) only from 13.3 on
(:data:`MIN_TILEIRAS_FOR_ARCH`). The GPU machines this project measures on have a CUDA 13.0
toolkit: cuTile runs there only from the carried wheels (``bench/cutile_carry.sh``).

The tileiras wheel is not enough on its own: tileiras loads libNVVM and runs ptxas from its
toolkit root (``$CUDA_HOME``, else the folder above its ``bin/``), which the
``nvidia-nvvm`` and ``nvidia-cuda-nvcc`` wheels of the same release provide, and cuda.tile
takes the wheel's tileiras only when the three share major.minor. Without them every compile
fails with "failed to compile Tile IR program" and no detail (seen on the H100 and
reproduced on a CPU machine: tileiras opens ``lib/libnvvm.so.4``, finds none and stops).

Registration is skipped, with an INFO log on ``torchgraft.dsl.cutile``, when cuda-tile is
missing, older than 1.0, no ``tileiras`` is found, or the tileiras wheel lacks its nvcc/nvvm
wheels (:func:`toolchain_reason`) (``TORCHGRAFT_SKIP_VERSION_CHECK=1`` skips these gates), or
``TORCH_DISABLE_NATIVE_JIT=1`` is set. Whether the found tileiras can
compile for a given GPU is :func:`arch_unusable_reason`'s question (it needs the GPU's compute
capability, which the gate does not ask for: asking initializes CUDA).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from torch._vendor.packaging.version import InvalidVersion, Version

from ._runtime import DSLRuntime, package_version

NAME = "cutile"
#: Distribution name on PyPI and the module it provides.
PACKAGE = "cuda-tile"
MODULE = "cuda.tile"
MIN_VERSION = "1.0"

#: The wheel that ships tileiras.
TILEIRAS_PACKAGE = "nvidia-cuda-tileiras"
#: The wheels the tileiras wheel needs at its own major.minor: ptxas (nvcc) and libNVVM (nvvm).
#: cuda.tile's ``_find_pip_tileiras`` asks for the same three.
TOOLCHAIN_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-nvvm")
#: Compute capability major -> the first tileiras release that compiles for it.
MIN_TILEIRAS_FOR_ARCH: dict[int, str] = {9: "13.3", 10: "13.1", 11: "13.1", 12: "13.1"}


def _tileiras_binary() -> str | None:
    """Where cuda-tile would find a toolkit's tileiras: PATH, then $CUDA_HOME/bin, then the
    default toolkit folder."""
    found = shutil.which("tileiras")
    if found is not None:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found = shutil.which("tileiras", path=os.path.join(home, "bin"))
            if found is not None:
                return found
    return None


@functools.cache
def tileiras_version() -> Version | None:
    """The version of the tileiras cuda-tile would use, or None when there is none.

    Read from the ``nvidia-cuda-tileiras`` wheel's metadata, else from ``tileiras --version``
    of a toolkit's binary (run once per process).
    """
    version = package_version(TILEIRAS_PACKAGE)
    if version is not None:
        return version
    binary = _tileiras_binary()
    if binary is None:
        return None
    try:
        text = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text) or re.search(r"\bV?(\d+\.\d+\.\d+)", text)
    try:
        return Version(match.group(1)) if match else None
    except InvalidVersion:
        return None


def toolchain() -> dict[str, str | None]:
    """The tileiras wheel and the wheels it needs: ``{package: version or None}``."""
    result: dict[str, str | None] = {}
    for package in (TILEIRAS_PACKAGE, *TOOLCHAIN_PACKAGES):
        version = package_version(package)
        result[package] = str(version) if version is not None else None
    return result


def toolchain_reason() -> str | None:
    """Why the installed tileiras wheel cannot compile (its nvcc/nvvm wheels are missing or of
    another release), or None (also when no tileiras wheel is installed: a toolkit's tileiras
    brings its own)."""
    tileiras = package_version(TILEIRAS_PACKAGE)
    if tileiras is None:
        return None
    release = tileiras.release[:2]
    wrong = [
        f"{package} {version if version is not None else 'missing'}"
        for package in TOOLCHAIN_PACKAGES
        if (version := package_version(package)) is None or version.release[:2] != release
    ]
    if not wrong:
        return None
    wanted = ".".join(str(part) for part in release)
    return (
        f"{TILEIRAS_PACKAGE} {tileiras} needs {' and '.join(TOOLCHAIN_PACKAGES)} {wanted}.x "
        f"beside it ({', '.join(wrong)}): without them every compile fails with 'failed to "
        "compile Tile IR program' (pip install cuda-tile[tileiras])"
    )


def _tileiras_reason(_cutile_version: Version) -> str | None:
    if tileiras_version() is None:
        return (
            "cuda-tile is installed but its tileiras compiler is not (pip install "
            "cuda-tile[tileiras], or a CUDA toolkit >= 13.1 on PATH or in $CUDA_HOME)"
        )
    return toolchain_reason()


def arch_unusable_reason(major: int) -> str | None:
    """Why cuTile kernels cannot be compiled for GPUs of compute capability ``major``.x with the
    tileiras found here, or None when they can."""
    version = tileiras_version()
    if version is None:
        return "no tileiras compiler found"
    needed = MIN_TILEIRAS_FOR_ARCH.get(major)
    if needed is None:
        return f"tileiras does not compile for compute capability {major}.x"
    if version < Version(needed):
        return f"tileiras {version} cannot compile for sm{major}x (needs >= {needed})"
    return None


runtime = DSLRuntime(
    NAME, package=PACKAGE, module=MODULE, min_version=MIN_VERSION, compat_fn=_tileiras_reason
)

runtime_available = runtime.runtime_available
runtime_version = runtime.runtime_version
register_op_override = runtime.register_op_override
deregister_op_overrides = runtime.deregister_op_overrides
reenable_op_overrides = runtime.reenable_op_overrides
