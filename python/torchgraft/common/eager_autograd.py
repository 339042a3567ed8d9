"""Eager calls of torchgraft's custom ops with their registered autograd formulas, without the
per-call Python work of ``torch.library.register_autograd``.

``register_autograd`` makes the dispatcher call back into Python at the op's Autograd key on
every call. That wrapper rebuilds the arguments from the schema (``fill_defaults``),
redispatches from Python and then runs an ``autograd.Function``. For the small fused ops this is
a large part of a call's host time, and host time is what a call-by-call step of small ops
waits for (docs/fused_elementwise.md, "Host time per call").

:func:`autograd_caller` returns a function that runs the same ``setup_context`` and
``backward`` through one ``autograd.Function`` whose forward enters the op below autograd, so
the dispatcher goes straight to the kernel in C++. It takes that path only for eager calls on
plain tensors. Under ``torch.compile`` or export tracing, ``torch.func`` transforms, and with
tensor subclasses, it calls the op itself, so that tracers and subclasses see the op and its
registered formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["autograd_caller", "register_autograd"]

# Tensor types that take the direct path: no __torch_dispatch__ or __torch_function__ of their own.
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def autograd_caller(
    op: torch._ops.OpOverload,
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> Callable[..., Any]:
    """A function that calls ``op`` with the autograd formula that ``setup_context`` and
    ``backward`` define, the same pair that is registered for ``op`` with
    ``torch.library.register_autograd``.

    Eager calls on plain tensors run through an ``autograd.Function`` whose forward calls the
    op below autograd. Calls that need no gradient call it below autograd directly. Every other
    call is ``op(*args, **kwargs)``. Pass every positional argument: ``setup_context`` sees
    ``args`` as given, with no schema defaults filled in.
    """
    keyword_only = [a for a in op._schema.arguments if a.kwarg_only]
    if any("Tensor" in str(a.type) for a in keyword_only):
        # `call` looks for tensors (plain? requiring grad?) among the positional arguments only.
        raise ValueError(f"{op}: keyword-only tensor arguments are not supported")
    takes_keyword_only = bool(keyword_only)

    # The keyword-only arguments travel as the last input, a dict (as register_autograd's own
    # Function passes them); it gets no gradient and is hidden from `backward`.
    def forward(ctx: Any, *inputs: Any) -> Any:
        *args, kwargs = inputs
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*args, **kwargs)
        if takes_keyword_only:
            setup_context(ctx=ctx, inputs=tuple(args), keyword_only_inputs=kwargs, output=output)
        else:
            setup_context(ctx=ctx, inputs=tuple(args), output=output)
        return output

    def backward_with_kwargs(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        needs_input_grad = ctx.needs_input_grad
        ctx.needs_input_grad = needs_input_grad[:-1]
        try:
            input_grads = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        if isinstance(input_grads, tuple):
            return (*input_grads, None)
        return input_grads, None

    function = type(
        f"{op._namespace}_{op._opname}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_with_kwargs)},
    )

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return op(*args, **kwargs)
        requires_grad = False
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in _PLAIN_TENSORS:
                    return op(*args, **kwargs)
                requires_grad = requires_grad or a.requires_grad
        if requires_grad and torch.is_grad_enabled():
            return function.apply(*args, kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    call.__name__ = call.__qualname__ = op._opname
    call.__doc__ = f"``{op}`` with its autograd formula (see torchgraft.common.eager_autograd)."
    return call


def register_autograd(
    op: torch._ops.OpOverload,
    backward: Callable[..., Any],
    setup_context: Callable[..., None],
) -> Callable[..., Any]:
    """Registers ``backward`` and ``setup_context`` for ``op`` with
    ``torch.library.register_autograd`` and returns :func:`autograd_caller`'s function for the
    same pair, so the op and the direct path cannot disagree."""
    torch.library.register_autograd(op, backward, setup_context=setup_context)
    return autograd_caller(op, setup_context, backward)
