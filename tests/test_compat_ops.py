"""The compatibility set's tour of the ops: every operator torchgraft computes, forward and
backward once on CPU, against float64 and with the counter that shows torchgraft's kernel ran.
CI runs it on every supported torch (marker ``compat``); each op's own test file goes deep."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F

import torchgraft
import torchgraft.functional as tgf
from torchgraft import native

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

# Relative-norm tolerance of a float32 result against float64 (sums of a few hundred terms).
TOL = 1e-5


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    return float((out64 - ref64).norm() / ref64.norm())


def calls(op: str) -> int:
    """Calls that reached torchgraft's CPU kernel of ``op`` (e.g. ``aten::_softmax``)."""
    return torchgraft.stats()[f"native/{op}/CPU"]["calls"]


def leaves(*shapes: Sequence[int]) -> list[torch.Tensor]:
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def check_forward_backward(
    run: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: list[torch.Tensor],
) -> None:
    """``run`` on float32 leaves and ``reference`` on their float64 copies give the same outputs
    and, for random upstream gradients, the same input gradients."""
    copies = [x.detach().double().requires_grad_() for x in inputs]
    outs = run(*inputs)
    refs = reference(*copies)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    upstream = [torch.randn_like(ref) for ref in refs]
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape
        assert rel_err(out, ref) < TOL
    torch.autograd.backward(outs, [g.to(out.dtype) for g, out in zip(upstream, outs, strict=True)])
    torch.autograd.backward(refs, upstream)
    for x, x64 in zip(inputs, copies, strict=True):
        assert rel_err(x.grad, x64.grad) < TOL


ATEN_GRAFTS = {
    "_fused_rms_norm": (lambda x, w: F.rms_norm(x, [96], w, 1e-6), "_fused_rms_norm_backward"),
    "_softmax": (lambda x: F.softmax(x, dim=-1), "_softmax_backward_data"),
    "_log_softmax": (lambda x: F.log_softmax(x, dim=-1), "_log_softmax_backward_data"),
    "native_layer_norm": (
        lambda x, w, b: F.layer_norm(x, [96], w, b),
        "native_layer_norm_backward",
    ),
}


@pytest.mark.parametrize("op", list(ATEN_GRAFTS))
def test_aten_graft_forward_and_backward(op: str) -> None:
    run, backward_op = ATEN_GRAFTS[op]
    inputs = leaves((4, 9, 96), *[(96,)] * (run.__code__.co_argcount - 1))
    with torchgraft.enabled():
        check_forward_backward(run, run, inputs)  # the float64 reference is ATen's kernel
    assert calls(f"aten::{op}") >= 1
    assert calls(f"aten::{backward_op}") >= 1


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_step(optimizer: type[torch.optim.Optimizer]) -> None:
    params = [torch.randn(37, 5), torch.randn(11)]
    copies = [p.double() for p in params]
    grafted = optimizer([p.requires_grad_() for p in params], lr=1e-2, fused=True)
    reference = optimizer([p.requires_grad_() for p in copies], lr=1e-2)
    with torchgraft.enabled():
        for _ in range(3):
            grads = [torch.randn_like(p) for p in params]
            for p, p64, g in zip(params, copies, grads, strict=True):
                p.grad, p64.grad = g, g.double()
            grafted.step()
            reference.step()
    for p, p64 in zip(params, copies, strict=True):
        assert rel_err(p, p64) < TOL
    name = "_fused_adamw_" if optimizer is torch.optim.AdamW else "_fused_adam_"
    assert calls(f"aten::{name}") == 3


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# Rotary tables (batch, sequence, head_dim) as a model computes them: no gradient.
COS, SIN = torch.randn(2, 12, 32, dtype=torch.float64), torch.randn(2, 12, 32, dtype=torch.float64)


def _rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tgf.rope(q, k, COS.to(q.dtype), SIN.to(q.dtype))


def _rope_reference(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = COS.unsqueeze(1), SIN.unsqueeze(1)  # transformers' apply_rotary_pos_emb
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


TARGET = torch.randint(0, 50, (24,))


def _routing_reference(logits: torch.Tensor) -> torch.Tensor:
    """The renormalized top-4 routing weights, in float64 (the selection is the kernel's: equal
    on random logits)."""
    probs = torch.softmax(logits, dim=-1)
    weights = torch.topk(probs, 4, dim=-1).values
    return weights / weights.sum(-1, keepdim=True)


# The sigmoid routers' correction bias (float64, as the float64 logits' weights).
SIGMOID_BIAS = torch.randn(16, dtype=torch.float64) * 0.2


def _sigmoid_routing_reference(logits: torch.Tensor) -> torch.Tensor:
    """The group-limited top-4 routing weights, in float64 (the selection is the kernel's:
    equal on random logits)."""
    scores = logits.sigmoid()
    choice = scores + SIGMOID_BIAS
    groups = choice.unflatten(-1, (4, 4)).topk(2, dim=-1).values.sum(-1)
    kept = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter(-1, kept, True)
    choice = choice.masked_fill(~mask.repeat_interleave(4, dim=-1), float("-inf"))
    weights = scores.gather(-1, choice.topk(4, dim=-1).indices)
    return 2.5 * weights / (weights.sum(-1, keepdim=True) + 1e-20)


# MoE token permutation: 24 tokens, 4 of 8 experts each, the pairs sorted by expert (stably)
# with torch's ops; every slot real.
MOE_IDS = torch.rand(24, 8).topk(4, dim=-1).indices
MOE_PERM = torch.sort(MOE_IDS.reshape(-1), stable=True).indices
MOE_INV = MOE_PERM.argsort()
MOE_VALID = torch.tensor([96], dtype=torch.int32)


def _moe_unpermute_reference(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' un-permute: weighted rows back in token order, summed per token."""
    return (y * w.reshape(-1, 1)[MOE_PERM])[MOE_INV].view(24, 4, -1).sum(1)


def _apply_gate_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' MoE experts' ``_apply_gate`` with SiLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


FUNCTIONAL = {
    "swiglu": (tgf.swiglu, lambda g, u: F.silu(g) * u, [(24, 64), (24, 64)]),
    "geglu": (tgf.geglu, lambda g, u: F.gelu(g) * u, [(24, 64), (24, 64)]),
    "swiglu_packed": (tgf.swiglu_packed, _apply_gate_reference, [(24, 128)]),
    "rope": (_rope, _rope_reference, [(2, 4, 12, 32), (2, 2, 12, 32)]),
    "rms_norm": (lambda x, w: tgf.rms_norm(x, w, 1e-6), _rms_norm_reference, [(24, 64), (64,)]),
    "cross_entropy": (
        lambda logits: tgf.cross_entropy(logits, TARGET),
        lambda logits: F.cross_entropy(logits, TARGET),
        [(24, 50)],
    ),
    "linear_cross_entropy": (
        lambda h, w: tgf.linear_cross_entropy(h, w, TARGET),
        lambda h, w: F.cross_entropy(F.linear(h, w), TARGET),
        [(24, 64), (50, 64)],
    ),
    "topk_softmax": (
        lambda logits: tgf.topk_softmax(logits, 4, renormalize=True)[0],
        _routing_reference,
        [(24, 16)],
    ),
    "topk_sigmoid": (
        lambda logits: tgf.topk_sigmoid(
            logits, 4, bias=SIGMOID_BIAS, groups=4, topk_groups=2, renormalize=True, scale=2.5
        )[0],
        _sigmoid_routing_reference,
        [(24, 16)],
    ),
    "moe_permute": (
        lambda h: tgf.moe_permute(h, MOE_PERM, MOE_VALID, 4),
        lambda h: h[MOE_PERM // 4],
        [(24, 64)],
    ),
    "moe_unpermute": (
        lambda y, w: tgf.moe_unpermute(y, MOE_INV, MOE_VALID, w, 4),
        _moe_unpermute_reference,
        [(96, 64), (24, 4)],
    ),
}


@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_functional_op_forward_and_backward(name: str) -> None:
    run, reference, shapes = FUNCTIONAL[name]
    check_forward_backward(run, reference, leaves(*shapes))
    assert calls(f"torchgraft::{name}") >= 1
