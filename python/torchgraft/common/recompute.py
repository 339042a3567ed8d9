"""Activations that the backward computes again instead of keeping: one saved tensor, named by
identity, is replaced in autograd's saved state by the recipe that made it.

A layer whose intermediate is cheap to make again from tensors that stay alive anyway (a gather
of rows from a saved input, an elementwise function of another saved tensor) need not keep it
through the forward: under :func:`recomputed`, when an op saves that tensor for its backward,
autograd keeps the recipe and its sources instead, and the backward runs the recipe when it
needs the tensor. As with autograd's own saved tensors, a source, or another tensor saved in the
block, modified in place after the forward makes the backward fail, not compute with changed
values (autograd itself does not check tensors that hooks packed: the hooks do).

Steps aside (the tensor is saved as usual) under torch.compile, outside grad mode, and inside
another saved-tensor hook (activation checkpointing, CPU offloading): the innermost hooks alone
apply, and taking the outer one's place would change what it does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = ["recomputed"]


_CHANGED = (
    "one of the variables needed for gradient computation has been modified by an inplace operation"
)
"""The start of autograd's own message for a saved tensor changed in place."""


class _Kept:
    """Another tensor saved in the block, kept as autograd keeps it: a detached alias (the same
    storage and version counter) and its version, checked in the backward (autograd does not
    check tensors that saved-tensor hooks packed)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        # Not the tensor itself: an op saving its own output would then hold the output, which
        # holds the op (its grad_fn), a cycle Python's collector cannot see.
        self.tensor = tensor.detach()
        self.version = tensor._version

    def __call__(self) -> Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"{_CHANGED}: a tensor saved inside a torchgraft layer whose intermediate the "
                f"backward computes again (saved at version {self.version}, now "
                f"{self.tensor._version})"
            )
        return self.tensor


class _Recipe:
    """What a dropped saved tensor is made from, and the sources' versions when it was made."""

    __slots__ = ("make", "sources", "versions")

    def __init__(self, make: Callable[[], Tensor], sources: tuple[Tensor, ...]) -> None:
        self.make = make
        self.sources = sources
        self.versions = tuple(s._version for s in sources)

    def __call__(self) -> Tensor:
        if tuple(s._version for s in self.sources) != self.versions:
            raise RuntimeError(
                f"{_CHANGED}: an input of a torchgraft layer whose intermediate the backward "
                "computes again (torchgraft.common.recompute)"
            )
        return self.make()


def _other_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # cannot tell: keep out of the way
        return True
    return top(False) is not None


@contextlib.contextmanager
def recomputed(
    target: Tensor, make: Callable[[], Tensor], sources: tuple[Tensor, ...]
) -> Iterator[None]:
    """Inside the block, ops that save ``target`` for their backward save ``make`` instead,
    and the backward calls it (``sources``: the tensors ``make`` reads, checked for in-place
    changes). ``make()`` must return ``target``'s values."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or _other_hooks_active():
        yield
        return

    # autograd keeps both hooks with every tensor saved in the block: a strong reference to the
    # target here would keep it alive as long as they are, the very memory this saves.
    target_ref = weakref.ref(target)

    def pack(t: Tensor) -> _Recipe | _Kept:
        return _Recipe(make, sources) if t is target_ref() else _Kept(t)

    def unpack(saved: _Recipe | _Kept) -> Tensor:
        return saved()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
