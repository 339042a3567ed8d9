"""torchgraft's switches, named as PyTorch names torch._native's (``torch.backends.python_native``).

::

    import torchgraft

    torchgraft.backends.triton.enabled = False          # the Triton overrides off
    with torchgraft.backends.native.disabled():          # the native grafts off in the block
        ...
    torchgraft.backends.disable_operations("_softmax")   # one op off, on every route
    with torchgraft.backends.operations_disabled("swiglu"):
        ...
    torchgraft.backends.available_dsls                   # ['native', 'triton', ...]

A DSL switch reaches that DSL's registry overrides (torchgraft's own and yours); the ``native``
one also the native grafts (the Rust and CUDA C++ kernels :func:`torchgraft.enable` registers
under aten ops). An op switch reaches every route: the registry's overrides of that op, its native
grafts, and layers :func:`torchgraft.adopt` routed to it, which run the model's own code while it
is off. Switches are sticky: they hold for grafts and overrides installed later, until switched
back. torch._native's own overrides are torch's: ``torch.backends.python_native`` switches those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torchgraft import control, dsl, registry
from torchgraft import native as _native_route

__all__ = [
    "DSLController",
    "cutedsl",
    "cutile",
    "disable_operations",
    "enable_operations",
    "get_dsl_operations",
    "helion",
    "is_dsl_disabled",
    "is_operation_disabled",
    "native",
    "operations_disabled",
    "triton",
]


class DSLController:
    """The switch of one DSL (``torchgraft.backends.<name>``)."""

    def __init__(self, name: str) -> None:
        if name not in dsl.DSLS:
            raise ValueError(f"unknown DSL {name!r}; known: {', '.join(dsl.DSLS)}")
        self._name = name

    @property
    def name(self) -> str:
        """The DSL's name, as ``register_op_override`` takes it."""
        return self._name

    @property
    def available(self) -> bool:
        """Whether the DSL's runtime is installed (found without importing it)."""
        return bool(dsl.DSLS[self._name].runtime_available())

    @property
    def version(self) -> object | None:
        """The installed runtime's version (a ``packaging`` Version), or None."""
        return dsl.DSLS[self._name].runtime_version()

    @property
    def enabled(self) -> bool:
        """Whether this DSL's overrides (and for ``native`` its grafts) may run. Settable."""
        return control.is_dsl_enabled(self._name)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        control.set_dsl_enabled(self._name, bool(value))

    def enable(self) -> None:
        """Switch this DSL back on."""
        control.set_dsl_enabled(self._name, True)

    def disable(self) -> None:
        """Switch this DSL off (until :meth:`enable`)."""
        control.set_dsl_enabled(self._name, False)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """This DSL off inside the ``with`` block; as it was before on exit (also after an
        exception)."""
        was_enabled = self.enabled
        self.disable()
        try:
            yield
        finally:
            if was_enabled:
                self.enable()

    def __repr__(self) -> str:
        available = "available" if self.available else "unavailable"
        enabled = "enabled" if self.enabled else "disabled"
        return f"DSLController({self._name}, {available}, {enabled})"


native = DSLController("native")
"""The native route: its grafts under aten ops and the registry's ``native`` overrides."""
triton = DSLController("triton")
cutedsl = DSLController("cutedsl")
helion = DSLController("helion")
cutile = DSLController("cutile")


def _all_dsls() -> list[str]:
    return list(dsl.DSLS)


def _available_dsls() -> list[str]:
    return [name for name, module in dsl.DSLS.items() if module.runtime_available()]


_MODULE_PROPERTIES = {"all_dsls": _all_dsls, "available_dsls": _available_dsls}


def __getattr__(name: str) -> list[str]:
    # ``all_dsls`` (every DSL torchgraft knows) and ``available_dsls`` (those whose runtime is
    # installed here) are read like torch.backends.python_native's module properties.
    if name in _MODULE_PROPERTIES:
        return _MODULE_PROPERTIES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_PROPERTIES])


def get_dsl_operations(dsl_name: str) -> list[str]:
    """The op symbols ``dsl_name`` has overrides for (every namespace; ``torch_nn`` ops
    qualified), sorted; for ``native`` also the ops of the native grafts of this build."""
    ops = set(registry.get_dsl_operations(dsl_name, "aten"))
    for lib in sorted(registry.ALLOWED_LIB_SYMBOLS - {"aten"}):
        ops.update(f"{lib}::{op}" for op in registry.get_dsl_operations(dsl_name, lib))
    if dsl_name == "native":
        ops.update(g.op.partition("::")[2] for g in _native_route.grafts())
    return sorted(ops)


def disable_operations(*op_symbols: str) -> None:
    """Switch these ops off on every route (until :func:`enable_operations`): their overrides,
    their native grafts, and adopted layers routed to them run PyTorch's (or the model's) code.

    An op symbol names one overload, as in torch._native: ``"_fused_adam_"`` and
    ``"_fused_adam_.tensor_lr"`` are two; ``"aten::mm"`` and ``"mm.default"`` mean ``"mm"``.
    torchgraft's own operators go by their bare name (``"swiglu"``, ``"rope"``).
    """
    control.set_operations_disabled(op_symbols, True)


def enable_operations(*op_symbols: str) -> None:
    """Switch these ops back on (see :func:`disable_operations`)."""
    control.set_operations_disabled(op_symbols, False)


@contextlib.contextmanager
def operations_disabled(*op_symbols: str) -> Iterator[None]:
    """These ops off inside the ``with`` block; on exit only those that were on before come
    back (also after an exception)."""
    were_on = [op for op in op_symbols if not is_operation_disabled(op)]
    disable_operations(*op_symbols)
    try:
        yield
    finally:
        enable_operations(*were_on)


def is_operation_disabled(op_symbol: str) -> bool:
    """Whether ``op_symbol`` was switched off by :func:`disable_operations`."""
    return control.is_operation_disabled(op_symbol)


def is_dsl_disabled(dsl_name: str) -> bool:
    """Whether ``dsl_name`` is switched off."""
    return not control.is_dsl_enabled(dsl_name)
