"""The optional dependency sets of the installed torchgraft pin versions the code accepts."""

from __future__ import annotations

import re
from importlib import metadata

import pytest
from torch._vendor.packaging.version import Version

from torchgraft.dsl import cutedsl

pytestmark = pytest.mark.default_torch

# "name[extras]==version; extra == 'attention'" as a wheel's metadata writes it.
PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*==\s*([^;\s]+)\s*;\s*extra\s*==\s*.(\w+).")


def _pins(extra: str) -> dict[str, Version]:
    pins = {}
    for line in metadata.requires("torchgraft") or []:
        m = PIN.match(line)
        if m and m.group(3) == extra:
            pins[m.group(1)] = Version(m.group(2))
    return pins


def test_the_attention_extra_pins_versions_the_cutedsl_route_accepts():
    pins = _pins("attention")
    assert set(pins) >= {*cutedsl.LIBRARIES, "nvidia-cutlass-dsl"}, pins
    for name, library in cutedsl.LIBRARIES.items():
        version = pins[name]
        assert version >= Version(library.min_version), name
        assert library.below_version is None or version < Version(library.below_version), name
    assert pins["nvidia-cutlass-dsl"] >= Version(cutedsl.MIN_VERSION)


def test_the_moe_extra_pins_quack_as_the_attention_extra_does():
    moe, attention = _pins("moe"), _pins("attention")
    assert set(moe) == {"quack-kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi"}, moe
    assert all(attention[name] == version for name, version in moe.items())
