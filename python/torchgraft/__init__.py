"""torchgraft: graft fast kernels under PyTorch's own operators.

Importing torchgraft changes nothing and imports no kernel DSL. :func:`enable` (or the scoped
``with torchgraft.enabled():``) installs torchgraft's grafts; unchanged model code then runs them.
:func:`register_op_override` grafts your own kernel, written in any DSL, the way ``torch._native``
does on torch 2.13+, on every torch from 2.11 to 2.15. :func:`adopt` routes a model's
hand-written layers (RMSNorm, gated MLPs, RoPE, the causal-LM head and loss) to the operators
torchgraft grafts and to :mod:`torchgraft.functional`'s fused ops, verified equal first;
:func:`unadopt` undoes it. :func:`disabled` (a ``with`` block) and ``TORCHGRAFT_DISABLE=1`` turn
all of it off; :mod:`torchgraft.backends` switches DSLs and ops one by one.
"""

from torchgraft import _logging, backends
from torchgraft.adopt import AdoptionReport, adopt, unadopt
from torchgraft.control import (
    disable,
    disabled,
    enable,
    enabled,
    is_enabled,
    reset_stats,
    stats,
)
from torchgraft.registry import (
    clear_overrides,
    deregister_op_overrides,
    list_overrides,
    native_decomp_table,
    reenable_op_overrides,
    register_op_override,
    reorder_overrides,
    suspend_routers,
)

__all__ = [
    "AdoptionReport",
    "adopt",
    "backends",
    "clear_overrides",
    "deregister_op_overrides",
    "disable",
    "disabled",
    "enable",
    "enabled",
    "is_enabled",
    "list_overrides",
    "native_decomp_table",
    "reenable_op_overrides",
    "register_op_override",
    "reorder_overrides",
    "reset_stats",
    "stats",
    "suspend_routers",
    "unadopt",
]

_logging.configure_from_env()
