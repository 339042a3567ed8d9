"""torchgraft.common.recompute: a saved tensor replaced by its recipe, made again in the backward,
with autograd's in-place check kept; the hooks step aside where another saved-tensor hook runs."""

from __future__ import annotations

import pytest
import torch

from torchgraft.common.recompute import recomputed

pytestmark = pytest.mark.default_torch


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, w


def test_the_backward_makes_the_tensor_again_and_gets_the_same_gradients() -> None:
    x, w = _inputs()
    want = torch.autograd.grad((x.exp() * w).sum(), (x, w))
    made: list[int] = []

    def again() -> torch.Tensor:
        made.append(1)
        return x.detach().exp()

    y = x.exp()
    with recomputed(y, again, (x,)):
        z = (y * w).sum()  # mul saves y (for w's gradient) and w
    assert made == []
    got = torch.autograd.grad(z, (x, w))
    assert made == [1]
    for g, e in zip(got, want, strict=True):
        assert torch.equal(g, e)


def test_a_source_changed_in_place_fails_the_backward() -> None:
    x, w = _inputs()
    base = x * 1.0
    y = base.exp()
    with recomputed(y, lambda: base.detach().exp(), (base,)):
        z = (y * w).sum()
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_it_steps_aside_inside_another_saved_tensor_hook() -> None:
    x, w = _inputs()
    made: list[int] = []
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x.exp()
        with recomputed(y, lambda: made.append(1) or x.detach().exp(), (x,)):
            z = (y * w).sum()
    z.backward()
    assert made == []  # the outer hook saw y itself
    assert any(t is y for t in seen)


def test_the_dropped_tensor_is_freed_after_the_forward() -> None:
    """Nothing keeps the target alive once its maker drops it (autograd holds the hooks with
    every tensor saved in the block: they must not hold the target)."""
    import gc
    import weakref

    x, w = _inputs()
    y = x.exp()
    with recomputed(y, lambda: x.detach().exp(), (x,)):
        z = (y * w).sum()
    dropped = weakref.ref(y)
    del y
    gc.collect()
    assert dropped() is None
    z.backward()
    assert x.grad is not None and torch.allclose(x.grad, x.detach().exp() * w.detach())


def test_other_tensors_saved_in_the_block_are_freed_with_their_graph() -> None:
    """An op in the block that saves its own output (``exp``) does not keep it alive: the pack
    hook must not return the tensor itself (output -> grad_fn -> saved output, a cycle)."""
    import gc
    import weakref

    x, _ = _inputs()
    t = x * 2.0
    with recomputed(t, lambda: x.detach() * 2.0, (x,)):
        y = torch.exp(x + 1.0)
    kept = weakref.ref(y)
    gc.disable()
    try:
        del y
        assert kept() is None
    finally:
        gc.enable()
    with recomputed(t, lambda: x.detach() * 2.0, (x,)):
        y = torch.exp(x + 1.0)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.exp(x.detach() + 1.0))


def test_another_tensor_saved_in_the_block_and_changed_in_place_fails_the_backward() -> None:
    """autograd skips its version check for tensors that hooks packed: the hooks keep it."""
    x, w = _inputs()
    a = x * 1.0
    t = x * 3.0
    with recomputed(t, lambda: x.detach() * 3.0, (x,)):
        z = (a * w).sum()  # mul saves a (for w's gradient)
    with torch.no_grad():
        a.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
