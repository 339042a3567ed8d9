"""quack's CuteDSL grouped GEMM under ``aten::_grouped_mm`` on CUDA (Hopper).

``torch._grouped_mm`` (and ``F.grouped_mm``) is what transformers' ``grouped_mm`` experts run:
the expert GEMMs of an MoE block over rows sorted by expert, the groups given by offsets. Its
forward and the gradient of its first operand are GEMMs whose groups split M (quack's varlen-M
GEMM), the gradient of its second operand one whose groups split K (varlen-K). quack's kernels
ran those 1.06-1.22x faster than ATen's at the MoE yardstick's Qwen3-MoE shapes on the H200
(``bench/grouped_mm_cuda.py``). ATen's derivative formula stays: its backward calls the op
again, and so reaches this graft too. Importing this package imports no DSL. Contents:

- :func:`register`, :func:`deregister`: the graft through torchgraft's registry.
- ``quack_cond.py``: which calls quack takes (metadata only; everything else runs ATen's kernel).
- ``quack_impl.py``: the impl, returning what ATen returns; ``quack_kernels.py``: the call into
  quack (imports it).
- :func:`grouped_mm_reference`: the float64 reference.
"""

from __future__ import annotations

from .reference import grouped_mm_reference
from .registration import deregister, register

__all__ = ["deregister", "grouped_mm_reference", "register"]
