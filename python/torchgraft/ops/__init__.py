"""Operator packages: one folder per aten operator that torchgraft grafts.

Each package holds a pure-PyTorch reference, the ``cond`` that decides which calls a kernel
takes, the ``impl`` that runs it (importing its DSL lazily), and the DSL kernels in their own
module. Importing a package here imports no DSL.
"""


def gate_notes() -> dict[tuple[str, str], str]:
    """``(route, op_symbol) -> why that route's override takes the calls it takes``, for every
    op package (``torchgraft list`` shows it). Imports no DSL."""
    from .attention.registration import notes as attention_notes
    from .linear_cross_entropy.registration import notes as linear_cross_entropy_notes
    from .rms_norm.registration import notes as rms_norm_notes

    return attention_notes() | linear_cross_entropy_notes() | rms_norm_notes()
