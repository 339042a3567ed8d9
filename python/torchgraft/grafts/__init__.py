"""The aten grafts' Python side: one folder per aten operator that torchgraft grafts.

A folder holds the op's pure-PyTorch reference, and for the grafts the Python route installs
(:mod:`.rms_norm`: Triton, CuteDSL, Helion; :mod:`.attention`: FA4 in CuteDSL) the ``cond``
that decides which calls a kernel takes, the ``impl`` that runs it (importing its DSL lazily),
the DSL kernels in their own module and the ``registration`` through :mod:`torchgraft.registry`.
Module names say their DSL (``triton_cond``, ``fa4_impl``). Importing a package here imports no
DSL. The native grafts (Rust, CUDA C++) are registered by :mod:`torchgraft.native`.
"""
