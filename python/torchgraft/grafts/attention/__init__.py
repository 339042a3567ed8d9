"""FlashAttention-4 (CuteDSL) under PyTorch's SDPA ops on CUDA.

``F.scaled_dot_product_attention`` reaches ``aten::_scaled_dot_product_cudnn_attention`` on
Hopper by default, ``..._flash_attention`` when the flash backend is chosen; FA4 is grafted
under both, forward and backward, where it computes the call and is measured faster
(:mod:`.crossover`). Importing this package imports no DSL. Contents:

- :func:`register`, :func:`deregister`: the graft through torchgraft's registry.
- ``support.py`` / ``crossover.py`` + ``crossover.json`` / ``fa4_cond.py``: what FA4 can compute,
  where it wins (measured data), and the conds built from both.
- ``fa4_impl.py``: the four impls, returning ATen's outputs in ATen's format.
- ``fa4_kernels.py``: the calls into flash-attn-4 (imports it).
- :func:`attention_reference`: the float64 reference.
"""

from __future__ import annotations

from .reference import attention_reference
from .registration import deregister, register

__all__ = ["attention_reference", "deregister", "register"]
