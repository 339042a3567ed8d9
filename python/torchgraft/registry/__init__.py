"""The graft registry: torch._native's override API on torch 2.11 to 2.15.

A kernel written in any DSL takes over an op at one backend dispatch key, for every call or
for the calls its ``cond`` accepts; every other call falls through to the kernel that was there
before. One router per (op, dispatch key) is installed through ``torch.library``:

* each call tries the conds in order (registration order, or what the ordering function makes
  of it); the first match runs its impl, whose result is checked against the op's schema and
  meta (``registry/outputs.py``);
* no match calls the previous kernel, captured with ``torch.library.get_kernel`` when the router
  was installed and called with ``call_boxed`` (captured again whenever what is below changes,
  ``registry/dispatch_slot.py``);
* inside an impl (or cond), calling the same op again, directly or from nested ops, reaches the
  previous kernel instead of the router (a per-thread guard), which is how an impl falls back.

Overrides are live as soon as they are registered. ``TORCHGRAFT_DISABLE=1`` (the kill switch) is
read at every change to the registry: while it is set, registering is a no-op and no router stays
in the dispatcher (see :func:`apply_kill_switch`). Nothing here imports a DSL. See
docs/registry.md for the composition order and the environment.

The package: :mod:`.overrides` (the state and every change to it), :mod:`.queries` (reading it),
:mod:`.info` (the snapshots both return), :mod:`.dispatch_slot` (one (op, key)'s router in the
dispatcher), :mod:`.router` and :mod:`.compile` (the eager and compiled routers),
:mod:`.outputs` (checking an impl's results), :mod:`.nodes`, :mod:`.env` and
:mod:`.torch_native` (interop with torch's own registry).
"""

from .info import FilterState, OverrideInfo
from .nodes import OverrideNode
from .outputs import OverrideResultError
from .overrides import (
    ALLOWED_LIB_SYMBOLS,
    UserOrderingFn,
    _slots,  # noqa: F401  (the registry's slots, read by tests)
    apply_kill_switch,
    clear_overrides,
    deregister_op_overrides,
    normalize_op_symbol,
    reenable_op_overrides,
    register_op_override,
    remove_override,
    reorder_overrides,
    suspend_routers,
)
from .queries import (
    filter_state,
    get_dsl_operations,
    list_overrides,
    native_decomp_table,
    override_stats,
    reset_stats,
)

__all__ = [
    "ALLOWED_LIB_SYMBOLS",
    "FilterState",
    "OverrideInfo",
    "OverrideNode",
    "OverrideResultError",
    "UserOrderingFn",
    "apply_kill_switch",
    "clear_overrides",
    "deregister_op_overrides",
    "filter_state",
    "get_dsl_operations",
    "list_overrides",
    "native_decomp_table",
    "normalize_op_symbol",
    "override_stats",
    "reenable_op_overrides",
    "register_op_override",
    "remove_override",
    "reorder_overrides",
    "reset_stats",
    "suspend_routers",
]
