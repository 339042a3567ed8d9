"""torchgraft.common.eager_autograd: the functional ops' direct eager path gives what the
registered autograd gives, and tracers, transforms and subclasses still see the op."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from conftest import rel_err
from torchgraft import functional as tgf
from torchgraft.common.eager_autograd import autograd_caller
from torchgraft.ops.rope.reference import rope_reference

pytestmark = pytest.mark.default_torch


def _rope_inputs(requires_grad: bool = True) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=requires_grad)
    k = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=requires_grad)
    cos, sin = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    return q, k, cos, sin


def _grads(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], seed: int):
    torch.manual_seed(seed)
    cotangents = [torch.randn_like(o) for o in outputs]
    return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)


# (name, through torchgraft.functional, through the op and its registered autograd, inputs)
CASES = [
    (
        "rope",
        lambda q, k, c, s: tgf.rope(q, k, c, s),
        lambda q, k, c, s: torch.ops.torchgraft.rope(q, k, c, s, 1),
        _rope_inputs,
    ),
    (
        "swiglu",
        lambda g, u: (tgf.swiglu(g, u),),
        lambda g, u: (torch.ops.torchgraft.swiglu(g, u),),
        lambda: tuple(torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in "gu"),
    ),
    (
        "geglu",
        lambda g, u: (tgf.geglu(g, u, "tanh"),),
        lambda g, u: (torch.ops.torchgraft.geglu(g, u, True),),
        lambda: tuple(torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in "gu"),
    ),
    (
        "rms_norm",
        lambda x, w: (tgf.rms_norm(x, w, 1e-6),),
        lambda x, w: (torch.ops.torchgraft.rms_norm(x, w, 1e-6, 0.0, False)[0],),
        lambda: (
            torch.randn(3, 16, dtype=torch.float64, requires_grad=True),
            torch.randn(16, dtype=torch.float64, requires_grad=True),
        ),
    ),
]

IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("name", "direct", "registered", "inputs"), CASES, ids=IDS)
def test_the_direct_path_equals_the_registered_autograd(name, direct, registered, inputs):
    args = inputs()
    fast, slow = direct(*args), registered(*args)
    # The direct path records its own node; the op call records register_autograd's.
    assert type(fast[0].grad_fn).__name__ == f"torchgraft_{name}Backward"
    assert type(slow[0].grad_fn).__name__.startswith("GeneratedBackwardFor_torchgraft")
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    differentiable = tuple(a for a in args if a.requires_grad)
    for a, b in zip(_grads(fast, differentiable, 0), _grads(slow, differentiable, 0), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("name", "direct", "registered", "inputs"), CASES, ids=IDS)
def test_calls_without_gradients_record_nothing(name, direct, registered, inputs):
    args = inputs()
    with torch.no_grad():
        outputs = direct(*args)
    assert all(o.grad_fn is None and not o.requires_grad for o in outputs)
    plain = direct(*(a.detach() for a in args))
    assert all(o.grad_fn is None and not o.requires_grad for o in plain)
    for a, b in zip(outputs, plain, strict=True):
        assert torch.equal(a, b)


def test_only_the_inputs_that_require_grad_get_gradients():
    def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    x = torch.randn(4, 16, dtype=torch.float64)
    weight = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
    w64 = weight.detach().clone().requires_grad_()
    tgf.rms_norm(x, weight, 1e-6).sum().backward()
    reference(x, w64).sum().backward()
    assert x.grad is None
    assert rel_err(weight.grad, w64.grad) < 1e-12

    x.requires_grad_()
    x64 = x.detach().clone().requires_grad_()
    frozen = weight.detach()
    tgf.rms_norm(x, frozen, 1e-6).sum().backward()
    reference(x64, frozen).sum().backward()
    assert frozen.grad is None
    assert rel_err(x.grad, x64.grad) < 1e-12


def test_compile_traces_the_op():
    seen: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        seen.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    q, k, cos, sin = _rope_inputs()
    compiled = torch.compile(lambda *a: tgf.rope(*a), backend=backend, fullgraph=True)
    out = compiled(q, k, cos, sin)
    assert torch.ops.torchgraft.rope.default in seen
    ref = rope_reference(q.detach(), k.detach(), cos, sin)
    assert all(rel_err(o, r) < 1e-12 for o, r in zip(out, ref, strict=True))


def test_tensor_subclasses_go_through_the_op():
    g = torch.randn(3, 5, dtype=torch.float64)
    u = torch.randn(3, 5, dtype=torch.float64)
    pair = TwoTensor(g.clone(), (2 * g).clone()).requires_grad_()
    y = tgf.swiglu(pair, TwoTensor(u, u))
    assert isinstance(y, TwoTensor)
    assert type(y.grad_fn).__name__.startswith("GeneratedBackwardFor_torchgraft")
    assert torch.equal(y.a, tgf.swiglu(g, u)) and torch.equal(y.b, tgf.swiglu(2 * g, u))


def test_keyword_only_tensor_arguments_are_refused():
    lib = torch.library.Library("torchgraft_test_eager", "FRAGMENT")
    lib.define("kw_tensor(Tensor x, *, Tensor y) -> Tensor")
    with pytest.raises(ValueError, match="keyword-only tensor arguments"):
        autograd_caller(torch.ops.torchgraft_test_eager.kw_tensor.default, print, print)
