"""torchgraft: graft fast kernels under PyTorch's own operators.

Importing torchgraft changes nothing and imports no kernel DSL. :func:`enable` (or the scoped
``with torchgraft.enabled():``) installs the grafts; unchanged model code then runs them.
"""

from torchgraft.control import disable, enable, enabled, is_enabled, reset_stats, stats

__all__ = [
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "reset_stats",
    "stats",
]
