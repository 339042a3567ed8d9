"""The operand checks of the native kernels, for fake and meta tensors.

Each ``torchgraft::`` op's Rust entry declares its operands once (``graft_abi::operands``):
which tensors, on which device, of which dtypes, sizes and layouts. A call with a meta or fake
tensor never reaches that entry: the dispatcher prefers the Meta key to every device, so the op's
fake function runs instead, for ``torch.compile``'s fake tensors and for any call with a meta
operand (also one mixed with CPU tensors, which must raise, not return an uninitialized CPU
tensor). :class:`Operands` is the same declaration in Python, with the same rules, order and
messages, so that each fake function states the table of its Rust entry.
``tests/reliability/test_operand_properties.py`` holds the two in step: drawn calls raise the same
error on meta tensors as on CPU tensors.

Of memory overlap, only what the sizes and strides tell is checked (a written operand whose
elements share memory: a stride of 0); fake tensors have no memory to share with each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["FLOATS", "INTERNAL_OVERLAP", "Operands", "c10_name", "sizes_text"]

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_C10_NAMES = {
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.float16: "Half",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.bool: "Bool",
    torch.bfloat16: "BFloat16",
}


def c10_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype ("Float", "BFloat16", "Long"), as ATen's messages print it."""
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def sizes_text(sizes: Sequence[Any]) -> str:
    """Sizes as c10 prints them: ``[3, 4]``."""
    return "[" + ", ".join(str(s) for s in sizes) + "]"


INTERNAL_OVERLAP = (
    "unsupported operation: more than one element of the written-to tensor refers to a single "
    "memory location. Please clone() the tensor before performing the operation."
)

_SAME_DEVICE = (
    "Expected all tensors to be on the same device, but found at least two devices, "
    "{want} and {got}!"
)
_DTYPE_LIKE = "{op}: expected {name} to have dtype {want}, got {got}"
_SIZES = "{op}: expected {name} of size {want}, got {got}"
_AT_DIM = "{op}: expected {name} of size {want} at dimension "


class _Operand:
    __slots__ = (
        "any_device",
        "dims",
        "dtype",
        "layout",
        "messages",
        "name",
        "sizes",
        "tensor",
        "written",
    )

    def __init__(self, name: str, tensor: Tensor, written: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.written = written
        self.any_device = False
        self.dtype: tuple[str, Any] | None = None
        self.dims: int | None = None
        self.sizes: tuple[str, Any] | None = None
        self.layout: tuple[str, Any] | None = None
        self.messages: dict[str, str] = {}


class Operands:
    """The operands of one op and what each must be; :meth:`check` checks them in the order
    they were declared (device, dtype, dimensions, sizes, layout of each) and raises the
    ``RuntimeError`` of the first broken rule.

    Each rule method applies to the operand declared last; :meth:`message` replaces the message
    of the rule set last, with ``{op}``, ``{name}``, ``{want}`` and ``{got}`` as placeholders.
    """

    def __init__(self, op: str) -> None:
        self._op = op
        self._list: list[_Operand] = []
        self._last_rule: str | None = None
        self._skipping = False

    def tensor(self, name: str, tensor: Tensor, *, written: bool = False) -> Operands:
        """An operand the op reads (``written``: writes)."""
        self._list.append(_Operand(name, tensor, written))
        self._last_rule = None
        self._skipping = False
        return self

    def written(self, name: str, tensor: Tensor) -> Operands:
        """An operand the op writes: none of its elements may share memory."""
        return self.tensor(name, tensor, written=True)

    def optional(self, name: str, tensor: Tensor | None) -> Operands:
        """An optional operand; when ``None``, the rules that follow apply to nothing."""
        if tensor is None:
            self._skipping = True
            return self
        return self.tensor(name, tensor)

    def _rule(self, rule: str, attr: str, value: Any) -> Operands:
        if not self._skipping:
            setattr(self._list[-1], attr, value)
            self._last_rule = rule
        return self

    def float(self) -> Operands:
        """float32, float64, bfloat16 or float16."""
        return self._rule("dtype", "dtype", ("float", None))

    def dtype(self, dtype: torch.dtype) -> Operands:
        """Exactly ``dtype``."""
        return self._rule("dtype", "dtype", ("is", dtype))

    def dtype_like(self, other: str) -> Operands:
        """The dtype of operand ``other``."""
        return self._rule("dtype", "dtype", ("like", other))

    def like(self, other: str) -> Operands:
        """The dtype and sizes of operand ``other``."""
        return self.dtype_like(other).sizes_like(other)

    def dims(self, dims: int) -> Operands:
        """This many dimensions (checked before the sizes)."""
        return self._rule("dims", "dims", dims)

    def sizes(self, sizes: Sequence[Any]) -> Operands:
        """Exactly these sizes."""
        return self._rule("sizes", "sizes", ("exactly", list(sizes)))

    def sizes_like(self, other: str) -> Operands:
        """The sizes of operand ``other``."""
        return self._rule("sizes", "sizes", ("like", other))

    def size(self, dim: int, size: Any) -> Operands:
        """Size ``size`` at dimension ``dim``."""
        return self._rule("sizes", "sizes", ("at", (dim, size)))

    def numel(self, numel: Any) -> Operands:
        """This many elements."""
        return self._rule("sizes", "sizes", ("numel", numel))

    def contiguous(self) -> Operands:
        """Row-major contiguous."""
        return self._rule("layout", "layout", ("contiguous", None))

    def any_device(self) -> Operands:
        """On any device (read by copying)."""
        return self._rule("device", "any_device", True)

    def message(self, template: str) -> Operands:
        """Replaces the message of the rule set last."""
        if not self._skipping:
            assert self._last_rule is not None, "a message follows the rule it replaces"
            self._list[-1].messages[self._last_rule] = template
        return self

    def _fail(self, o: _Operand, rule: str, default: str, want: Any, got: Any) -> RuntimeError:
        template = o.messages.get(rule, default)
        return RuntimeError(
            template.replace("{op}", self._op)
            .replace("{name}", o.name)
            .replace("{want}", str(want))
            .replace("{got}", str(got))
        )

    def _find(self, name: str) -> Tensor:
        return next(o.tensor for o in self._list if o.name == name)

    def check(self) -> None:
        """Checks every rule; raises ``RuntimeError`` for the first broken one."""
        device = next((o.tensor.device for o in self._list if not o.any_device), None)
        for o in self._list:
            t = o.tensor
            if not o.any_device and t.device != device:
                raise self._fail(o, "device", _SAME_DEVICE, device, t.device)
            self._check_dtype(o, t)
            if o.dims is not None and t.dim() != o.dims:
                default = "{op}: expected {name} to have {want} dimensions, got {got}"
                raise self._fail(o, "dims", default, o.dims, t.dim())
            self._check_sizes(o, t)
            if o.layout is not None and not t.is_contiguous():
                raise self._fail(o, "layout", "{op}: {name} must be contiguous", "", "")
        for o in self._list:
            shape, strides = o.tensor.shape, o.tensor.stride()
            if o.written and any(st == 0 and sz > 1 for sz, st in zip(shape, strides, strict=True)):
                raise RuntimeError(INTERNAL_OVERLAP)

    def _check_dtype(self, o: _Operand, t: Tensor) -> None:
        if o.dtype is None:
            return
        kind, arg = o.dtype
        if kind == "float":
            if t.dtype not in FLOATS:
                default = "\"{op}\" not implemented for '{got}'"
                raise self._fail(o, "dtype", default, "", c10_name(t.dtype))
            return
        want = arg if kind == "is" else self._find(arg).dtype
        if t.dtype != want:
            raise self._fail(o, "dtype", _DTYPE_LIKE, c10_name(want), c10_name(t.dtype))

    def _check_sizes(self, o: _Operand, t: Tensor) -> None:
        if o.sizes is None:
            return
        kind, arg = o.sizes
        if kind == "numel":
            if t.numel() != arg:
                default = "{op}: {name} has {got} elements, expected {want}"
                raise self._fail(o, "sizes", default, arg, t.numel())
            return
        if kind == "at":
            dim, want = arg
            if t.dim() <= dim or t.shape[dim] != want:
                got = t.shape[dim] if t.dim() > dim else "no such dimension"
                default = f"{_AT_DIM}{dim}, got {{got}}"
                raise self._fail(o, "sizes", default, want, got)
            return
        want = arg if kind == "exactly" else list(self._find(arg).shape)
        if list(t.shape) != want:
            raise self._fail(o, "sizes", _SIZES, sizes_text(want), sizes_text(t.shape))
