"""What an override's impl must return, checked against the op's schema and its own meta.

The dispatcher converts whatever a Python kernel returns into the op's declared returns; a
result of the wrong shape (three tensors for a two-output op) crashes the process there, and a
well-formed result of the wrong shape, dtype or device is passed on silently. So each result is
checked at three levels, cheapest first:

* **structure**, every call: as many values as the schema returns, tensors (or None, an
  undefined tensor) where it returns tensors, lists of tensors where it returns ``Tensor[]``;
* **metadata**, on the first call for each input signature (every call in strict mode): each
  tensor's shape, dtype and device equal those of the op's own meta/fake result for the same
  inputs, and its strides too where the return is a view of an input (``Tensor(a)``, the only
  returns whose strides the schema fixes); None where the op returns none;
* **values**, strict mode only (``TORCHGRAFT_STRICT=1``): the kernel below the router runs on
  the same inputs (copies of the ones the op writes) and the largest difference is recorded
  per override (``shadow_checks`` and ``max_error`` in ``override_stats()``).

A failed check raises :class:`OverrideResultError` naming the override, its DSL, its impl and
what differed. The input signature is each tensor's (shape, dtype, device index) plus the other
arguments' values; a node remembers up to :data:`MAX_SIGNATURES` of them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .nodes import OverrideNode

__all__ = [
    "MAX_SIGNATURES",
    "OverrideResultError",
    "ResultCheck",
    "Returns",
    "max_difference",
    "returns_of",
]

log = logging.getLogger("torchgraft.registry")

#: Input signatures remembered per override (oldest forgotten first): bounds memory for models
#: whose shapes keep changing; a forgotten signature is checked again when it comes back.
MAX_SIGNATURES = 1024

TENSOR = "Tensor"
TENSOR_LIST = "Tensor[]"
OTHER = "other"

#: (return index, argument position or keyword name) for each return that aliases a written arg.
AliasCheck = tuple[int, int | str]


class OverrideResultError(RuntimeError):
    """An override's impl returned something other than what its op returns."""


def _kind(value_type: torch._C.JitType) -> str:
    if isinstance(value_type, torch._C.OptionalType):
        value_type = value_type.getElementType()
    if isinstance(value_type, torch._C.TensorType):
        return TENSOR
    if isinstance(value_type, torch._C.ListType):
        element = value_type.getElementType()
        if isinstance(element, torch._C.OptionalType):
            element = element.getElementType()
        if isinstance(element, torch._C.TensorType):
            return TENSOR_LIST
    return OTHER


@dataclass(frozen=True)
class Returns:
    """What an op's schema says it returns, read once per router."""

    #: Qualified op name, e.g. ``"aten::mm"``.
    op: str
    #: One of TENSOR, TENSOR_LIST, OTHER per return.
    kinds: tuple[str, ...]
    #: Returns that are views of an input (aliased, not written): their strides are fixed.
    views: frozenset[int]
    #: In-place and out= returns: the argument the impl must return itself.
    aliased: tuple[AliasCheck, ...]
    #: Arguments the op writes (positions or keyword names): copied before a shadow run.
    written: tuple[int | str, ...]

    @property
    def declared(self) -> str:
        return "(" + ", ".join(self.kinds) + ")" if len(self.kinds) != 1 else self.kinds[0]


def returns_of(overload: torch._ops.OpOverload) -> Returns:
    """Read the returns, views, aliases and written arguments of ``overload``'s schema."""
    schema = overload._schema
    aliased: list[AliasCheck] = []
    views: set[int] = set()
    written: list[int | str] = []
    for arg_index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(arg.name if arg.kwarg_only else arg_index)
    for ret_index, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is None:
            continue
        if not info.is_write:
            views.add(ret_index)
            continue
        for arg_index, arg in enumerate(schema.arguments):
            arg_info = arg.alias_info
            if (
                arg_info is not None
                and arg_info.is_write
                and arg_info.before_set == info.before_set
            ):
                aliased.append((ret_index, arg.name if arg.kwarg_only else arg_index))
                break
    return Returns(
        op=f"{schema.name}" + (f".{schema.overload_name}" if schema.overload_name else ""),
        kinds=tuple(_kind(ret.type) for ret in schema.returns),
        views=frozenset(views),
        aliased=tuple(aliased),
        written=tuple(written),
    )


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ", ".join(_describe(v) for v in value) + "]"
    return type(value).__name__


def _as_values(result: Any, n_returns: int) -> tuple[Any, ...] | None:
    """The result as one value per return, or None when its number of values is wrong."""
    if n_returns == 1:
        return (result,)
    if n_returns == 0:
        return () if result is None or (isinstance(result, tuple) and not result) else None
    if isinstance(result, (tuple, list)) and len(result) == n_returns:
        return tuple(result)
    return None


def _structure_problem(result: Any, returns: Returns) -> str | None:
    values = _as_values(result, len(returns.kinds))
    if values is None:
        count = len(result) if isinstance(result, (tuple, list)) else 1
        return (
            f"returned {count} value(s), {_describe(result)}; {returns.op} returns "
            f"{len(returns.kinds)}: {returns.declared}"
        )
    for index, (value, kind) in enumerate(zip(values, returns.kinds, strict=True)):
        if kind == TENSOR and not (value is None or isinstance(value, Tensor)):
            return f"output {index} is {_describe(value)}, {returns.op} returns a Tensor there"
        if kind == TENSOR_LIST and not (
            isinstance(value, (list, tuple))
            and all(v is None or isinstance(v, Tensor) for v in value)
        ):
            return f"output {index} is {_describe(value)}, {returns.op} returns a Tensor[] there"
    return None


# ----------------------------------------------------------------------------- signatures
# Computed on every call an impl takes, so kept to plain attribute reads: (shape, dtype) per
# tensor, plus the device index where one key can see several devices (CUDA:0 and CUDA:1 share
# the CUDA key; at CPU every tensor is a CPU tensor), plus every other argument's value.


def _item_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (value.shape, value.dtype, value.get_device())
    if isinstance(value, (list, tuple)):
        return tuple([_item_key(v) for v in value])
    return value


def _item_key_strided(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (
            value.shape,
            value.stride(),
            value.storage_offset(),
            value.dtype,
            value.get_device(),
        )
    if isinstance(value, (list, tuple)):
        return tuple([_item_key_strided(v) for v in value])
    return value


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What the op's output metadata depends on: tensor shapes, dtypes, devices; other values."""
    key: list[Any] = []
    for a in args:
        if a.__class__ is Tensor:
            key += (a.shape, a.dtype, a.get_device())
        else:
            key.append(_item_key(a))
    if kwargs:
        key += [(name, _item_key(value)) for name, value in kwargs.items()]
    return tuple(key)


def cpu_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`signature` for the CPU key, where every tensor is on the one CPU device."""
    key: list[Any] = []
    for a in args:
        if a.__class__ is Tensor:
            key += (a.shape, a.dtype)
        else:
            key.append(_item_key(a))
    if kwargs:
        key += [(name, _item_key(value)) for name, value in kwargs.items()]
    return tuple(key)


def strided_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`signature` plus strides and offsets, for ops returning views of their inputs."""
    key = [_item_key_strided(a) for a in args]
    if kwargs:
        key.extend([(name, _item_key_strided(value)) for name, value in kwargs.items()])
    return tuple(key)


def _plain_result(n_returns: int) -> Callable[[Any], bool]:
    """A quick test that passes the usual well-formed results of an all-Tensor op."""
    if n_returns == 1:
        return lambda result: result.__class__ is Tensor
    return lambda result: (
        result.__class__ is tuple
        and len(result) == n_returns
        and all([v is None or v.__class__ is Tensor for v in result])
    )


# ----------------------------------------------------------------------------- meta comparison


class _Unknown:
    """The op's meta result could not be computed for these inputs."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def expected_result(
    overload: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The op's result on fake copies of the inputs (shapes, dtypes, devices, strides only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    try:
        mode = FakeTensorMode()
        fake_args, fake_kwargs = tree_map_only(Tensor, mode.from_tensor, (args, kwargs))
        with mode:
            return overload(*fake_args, **fake_kwargs)
    except Exception as exc:  # data-dependent shapes, ops without a meta kernel, ...
        return _Unknown(f"{type(exc).__name__}: {exc}")


def _tensor_problems(where: str, got: Any, want: Any, strides: bool) -> list[str]:
    if got is None and want is None:
        return []
    if got is None:
        return [
            f"{where} is None, the op returns a {want.dtype} tensor of shape {tuple(want.shape)}"
        ]
    if want is None:
        return [f"{where} is a tensor, the op returns None (no tensor) there"]
    problems = []
    if got.shape != want.shape:
        problems.append(f"{where} has shape {tuple(got.shape)}, the op's is {tuple(want.shape)}")
    if got.dtype != want.dtype:
        problems.append(f"{where} has dtype {got.dtype}, the op's is {want.dtype}")
    if got.device != want.device:
        problems.append(f"{where} is on {got.device}, the op's is on {want.device}")
    if strides and not problems and got.stride() != want.stride():
        problems.append(
            f"{where} (a view of an input) has strides {got.stride()}, the op's are {want.stride()}"
        )
    if strides and not problems and got.storage_offset() != want.storage_offset():
        problems.append(
            f"{where} (a view of an input) has storage offset {got.storage_offset()}, "
            f"the op's is {want.storage_offset()}"
        )
    return problems


def metadata_problems(result: Any, expected: Any, returns: Returns) -> list[str]:
    """How ``result`` differs from the op's meta result ``expected`` (empty: it does not)."""
    n_returns = len(returns.kinds)
    got_values, want_values = _as_values(result, n_returns), _as_values(expected, n_returns)
    if got_values is None or want_values is None:
        return []  # structure is checked separately; a meta kernel is trusted to match its schema
    problems: list[str] = []
    for index, kind in enumerate(returns.kinds):
        got, want = got_values[index], want_values[index]
        where = "the output" if n_returns == 1 else f"output {index}"
        strides = index in returns.views
        if kind == TENSOR:
            problems += _tensor_problems(where, got, want, strides)
        elif kind == TENSOR_LIST:
            if len(got) != len(want):
                problems.append(f"{where} has {len(got)} tensors, the op's has {len(want)}")
                continue
            for item, (g, w) in enumerate(zip(got, want, strict=True)):
                problems += _tensor_problems(f"{where}[{item}]", g, w, strides)
    return problems


# ----------------------------------------------------------------------------- shadow values


def _pairs(result: Any, reference: Any, returns: Returns) -> list[tuple[Any, Any]]:
    n_returns = len(returns.kinds)
    got_values, ref_values = _as_values(result, n_returns), _as_values(reference, n_returns)
    if got_values is None or ref_values is None:
        return [(result, None)]
    pairs: list[tuple[Any, Any]] = []
    for kind, got, ref in zip(returns.kinds, got_values, ref_values, strict=True):
        if kind == TENSOR:
            pairs.append((got, ref))
        elif kind == TENSOR_LIST:
            if len(got) != len(ref):
                return [(got, None)]
            pairs.extend(zip(got, ref, strict=True))
    return pairs


def max_difference(result: Any, reference: Any, returns: Returns) -> float:
    """Largest absolute elementwise difference between two results of the op (float64).

    Equal values, equal infinities and NaN against NaN count as 0; a NaN against a number, a
    tensor against None, or different shapes count as infinity.
    """
    worst = 0.0
    for got, ref in _pairs(result, reference, returns):
        if got is None and ref is None:
            continue
        if not isinstance(got, Tensor) or not isinstance(ref, Tensor) or got.shape != ref.shape:
            return math.inf
        if got.numel() == 0:
            continue
        wide = torch.complex128 if got.is_complex() or ref.is_complex() else torch.float64
        a = got.detach().to(device=ref.device, dtype=wide)
        b = ref.detach().to(dtype=wide)
        same = (a == b) | (a.isnan() & b.isnan())
        diff = (a - b).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf)
        worst = max(worst, float(diff.max()))
    return worst


def _copy_written(
    args: tuple[Any, ...], kwargs: dict[str, Any], written: tuple[int | str, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with each one the op writes replaced by a copy of it."""
    if not written:
        return args, kwargs
    new_args, new_kwargs = list(args), dict(kwargs)
    for where in written:
        if isinstance(where, str):
            if isinstance(new_kwargs.get(where), Tensor):
                new_kwargs[where] = new_kwargs[where].clone()
        elif where < len(new_args) and isinstance(new_args[where], Tensor):
            new_args[where] = new_args[where].clone()
    return tuple(new_args), new_kwargs


# ----------------------------------------------------------------------------- the check


def _impl_name(node: OverrideNode) -> str:
    fn = node.impl_fn
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


class ResultCheck:
    """Checks one override's results for one op; built with the router, called after each impl.

    Args:
        node: The override.
        overload: The op it overrides.
        strict: Check metadata on every call and compare values with the kernel below.
        below: Calls the kernel below the router (``below(keyset, *args, **kwargs)``), for the
            shadow run; None when there is no kernel below.
    """

    def __init__(
        self,
        node: OverrideNode,
        overload: torch._ops.OpOverload,
        returns: Returns,
        *,
        strict: bool,
        below: Callable[..., Any] | None,
    ) -> None:
        self.node = node
        self.overload = overload
        self.returns = returns
        self.strict = strict
        self.below = below if strict else None
        if returns.views:
            self.signature = strided_signature
        elif node.dispatch_key == "CPU":
            self.signature = cpu_signature
        else:
            self.signature = signature
        # Results that need no closer look at their structure (everything else gets one).
        all_tensors = bool(returns.kinds) and all(k == TENSOR for k in returns.kinds)
        self.plain = _plain_result(len(returns.kinds)) if all_tensors else lambda result: False

    def fail(self, what: str) -> OverrideResultError:
        node = self.node
        return OverrideResultError(
            f"torchgraft override {node.stats_key} (DSL {node.dsl_name!r}, impl "
            f"{_impl_name(node)}) returned a wrong result for {self.returns.op}: {what}"
        )

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Strict mode: copies of the arguments the op writes, taken before the impl runs."""
        if self.below is None:
            return None
        return _copy_written(args, kwargs, self.returns.written)

    def __call__(
        self,
        result: Any,
        keyset: torch.DispatchKeySet,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        saved: Any = None,
    ) -> None:
        """Raise :class:`OverrideResultError` unless ``result`` is what the op would return."""
        returns = self.returns
        if not self.plain(result):
            problem = _structure_problem(result, returns)
            if problem is not None:
                raise self.fail(problem)
        for ret_index, where in returns.aliased:
            expected = kwargs.get(where) if isinstance(where, str) else args[where]
            got = result if len(returns.kinds) == 1 else result[ret_index]
            if got is not expected:
                name = where if isinstance(where, str) else f"argument {where}"
                raise self.fail(
                    f"the op writes its result into {name} and must return that same tensor; "
                    "the impl returned another object. Write in place (e.g. out.copy_(result)) "
                    "and return it."
                )
        checked = self.node.checked
        key = None if self.strict else self.signature(args, kwargs)
        try:
            if key is not None and key in checked:
                return
        except TypeError:  # an unhashable argument: no signature, so check every call
            key = None
        self._check_metadata(result, args, kwargs)
        if key is not None:
            if len(checked) >= MAX_SIGNATURES:
                try:
                    del checked[next(iter(checked))]
                except (RuntimeError, KeyError, StopIteration):
                    pass  # another thread changed it meanwhile; it stays bounded anyway
            checked[key] = None
        if saved is not None and self.below is not None:
            self._shadow(result, keyset, saved)

    def _check_metadata(self, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        expected = expected_result(self.overload, args, kwargs)
        if isinstance(expected, _Unknown):
            log.debug(
                "%s: no meta result for %s to check against (%s)",
                self.node.stats_key,
                self.returns.op,
                expected.reason,
            )
            return
        problems = metadata_problems(result, expected, self.returns)
        if problems:
            raise self.fail(
                "; ".join(problems) + f" (expected: {self.returns.op}'s meta result for the "
                "same inputs)"
            )

    def _shadow(self, result: Any, keyset: torch.DispatchKeySet, saved: Any) -> None:
        assert self.below is not None
        ref_args, ref_kwargs = saved
        reference = self.below(keyset, *ref_args, **ref_kwargs)
        error = max_difference(result, reference, self.returns)
        node = self.node
        node.shadow_checks += 1
        if error > node.max_error or math.isnan(error):
            node.max_error = error
