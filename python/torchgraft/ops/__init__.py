"""Operator packages: one folder per aten operator that torchgraft grafts.

Each package holds a pure-PyTorch reference, the ``cond`` that decides which calls a kernel
takes, the ``impl`` that runs it (importing its DSL lazily), and the DSL kernels in their own
module. Importing a package here imports no DSL.
"""
