"""The cuTile RMSNorm without a GPU: where cuda-tile and its toolchain are installed, both
kernels compile for Hopper ahead of time (cuTile's ``export_kernel`` runs tileiras, libNVVM and
ptxas, none of which needs a GPU). Skipped where cuTile is not usable, as in CI."""

from __future__ import annotations

import pytest
import torch

from torchgraft.dsl import cutile

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.slow,
    pytest.mark.skipif(
        cutile.runtime.unusable_reason() is not None or cutile.arch_unusable_reason(9) is not None,
        reason=f"cuTile cannot compile for sm90 here: "
        f"{cutile.runtime.unusable_reason() or cutile.arch_unusable_reason(9)}",
    ),
]


def test_kernels_compile_for_hopper_without_a_gpu():
    from torchgraft.grafts.rms_norm import cutile_kernels

    cubins = cutile_kernels.compile_ahead("sm_90", 4096, torch.bfloat16)
    assert set(cubins) == {"forward", "backward"}
    for cubin in cubins.values():
        assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image
