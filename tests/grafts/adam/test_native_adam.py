"""The native fused Adam / AdamW grafts on CPU: bitwise equal to ATen's own fused CPU kernel,
close to a float64 reference, ATen's errors, optimizers unchanged, counters and control."""

from __future__ import annotations

import pytest
import torch

import torchgraft
from torchgraft import native
from torchgraft.cli import list_rows
from torchgraft.grafts.adam.reference import AdamConfig, AdamState, adam_step_reference

pytestmark = [
    pytest.mark.default_torch,
    pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built"),
]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Lengths around ATen's vector widths (4, 8 and 16 lanes) and its loop tails, plus larger ones
# that span several of the kernel's chunks and threads.
SIZES = [1, 3, 7, 8, 15, 16, 17, 31, 33, 100, 1000, 4099, 70001]
OPS = {"adamw": torch._fused_adamw_, "adam": torch._fused_adam_}
# Option sets: plain; decay, maximize and AMP grad scale; a small beta1 (lerp's other branch)
# with the tensor-lr overload.
VARIANTS = {
    "plain": dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False),
    "decay_max_scale": dict(
        lr=3e-2, beta1=0.85, beta2=0.99, weight_decay=0.1, eps=1e-6, maximize=True, scale=1024.0
    ),
    "small_beta_tensor_lr": dict(
        lr=1e-2, beta1=0.3, beta2=0.95, weight_decay=0.05, eps=1e-8, maximize=False, lr_tensor=True
    ),
}


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def key(op: str, overload: str = "") -> str:
    name = f"aten::_fused_{op}_" + (f".{overload}" if overload else "")
    return f"native/{name}/CPU"


def calls(k: str) -> int:
    return torchgraft.stats()[k]["calls"]


def make_lists(sizes: list[int], dtype: torch.dtype, amsgrad: bool) -> list[list[torch.Tensor]]:
    """Fresh random optimizer state (never zeros): params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs and per-tensor float32 step counts."""

    def rnd(n: int, scale: float = 1.0, positive: bool = False) -> torch.Tensor:
        t = torch.randn(n, dtype=torch.float64) * scale
        return (t.abs() if positive else t).to(dtype)

    params = [rnd(n) for n in sizes]
    grads = [rnd(n, 0.5) for n in sizes]
    exp_avgs = [rnd(n, 0.1) for n in sizes]
    exp_avg_sqs = [rnd(n, 0.01, positive=True) for n in sizes]
    maxes = [rnd(n, 0.01, positive=True) for n in sizes] if amsgrad else []
    steps = [torch.tensor(float(torch.randint(1, 200, ()).item())) for _ in sizes]
    return [params, grads, exp_avgs, exp_avg_sqs, maxes, steps]


def clone(lists: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in lst] for lst in lists]


def run(op: str, lists: list[list[torch.Tensor]], amsgrad: bool, variant: dict) -> None:
    v = dict(variant)
    scale = v.pop("scale", None)
    lr_tensor = v.pop("lr_tensor", False)
    lr = torch.tensor(v.pop("lr")) if lr_tensor else v.pop("lr")
    grad_scale = None if scale is None else torch.tensor(scale)
    OPS[op](*lists, lr=lr, amsgrad=amsgrad, grad_scale=grad_scale, **v)


def assert_bitwise(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]) -> None:
    names = ["params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"]
    for name, a, b in zip(names, ours, theirs, strict=False):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            differ = int((x != y).sum())
            assert differ == 0, f"{name}[{i}] ({x.numel()} elements): {differ} differ from ATen"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bitwise_equal_to_aten(dtype, op, amsgrad, variant):
    lists = make_lists(SIZES, dtype, amsgrad)
    theirs, ours = clone(lists), clone(lists)
    run(op, theirs, amsgrad, VARIANTS[variant])
    with torchgraft.enabled():
        run(op, ours, amsgrad, VARIANTS[variant])
    overload = "tensor_lr" if VARIANTS[variant].get("lr_tensor") else ""
    assert calls(key(op, overload)) == 1
    # The moments changed (so none was left unwritten), and everything equals ATen's to the bit.
    for before, after in zip(lists[2], ours[2], strict=True):
        assert (before != after).float().mean() > 0.5
    assert_bitwise(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("amsgrad", [False, True])
def test_close_to_float64_reference(dtype, op, amsgrad):
    cfg = AdamConfig(
        lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1, amsgrad=amsgrad, adamw=op == "adamw"
    )
    lists = make_lists([5, 64, 1000], dtype, amsgrad)
    ours = clone(lists)
    with torchgraft.enabled():
        OPS[op](
            *ours,
            lr=cfg.lr,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=amsgrad,
            maximize=False,
        )
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for i in range(3):
        maxes = lists[4][i] if amsgrad else None
        before = AdamState(lists[0][i], lists[1][i], lists[2][i], lists[3][i], maxes)
        ref = adam_step_reference(before, float(lists[5][i]), cfg)
        p0 = lists[0][i].double()
        # The update (new minus old), so that the parameter's own size does not hide errors.
        delta, ref_delta = ours[0][i].double() - p0, ref.param - p0
        assert ((delta - ref_delta).norm() / ref_delta.norm()).item() < tol
        for got, want in [(ours[2][i], ref.exp_avg), (ours[3][i], ref.exp_avg_sq)]:
            assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_dense_non_contiguous_layouts_step_in_memory_order():
    # Transposed (dense, not contiguous) tensors sharing one layout: ATen walks memory order,
    # so does the graft (its loop tail falls on the same elements).
    lists = make_lists([33 * 65], torch.float32, False)
    lists[:4] = [[t.view(33, 65).t() for t in lst] for lst in lists[:4]]
    theirs, ours = clone(lists), clone(lists)
    for lst in (theirs, ours):
        lst[:4] = [[t.t().contiguous().t() for t in group] for group in lst[:4]]
    run("adamw", theirs, False, VARIANTS["decay_max_scale"])
    with torchgraft.enabled():
        run("adamw", ours, False, VARIANTS["decay_max_scale"])
    assert not ours[0][0].is_contiguous()
    assert calls(key("adamw")) == 1
    assert torchgraft.stats()[key("adamw")]["fallbacks"] == 0
    assert_bitwise(ours, theirs)


def test_strided_tensors_are_computed_elementwise():
    # Every other element of larger buffers: ATen would read the buffers as flat arrays; the
    # graft steps the tensors' own elements (through copies) and leaves the gaps alone.
    cfg = AdamConfig(lr=0.1, weight_decay=0.1)
    lists = make_lists([2 * 500], torch.float64, False)
    views = [[t[::2] for t in lst] if i < 4 else lst for i, lst in enumerate(lists)]
    before = AdamState(*(v[0].clone() for v in views[:4]))
    gaps = [lst[0][1::2].clone() for lst in lists[:4]]
    with torchgraft.enabled():
        torch._fused_adamw_(
            *views,
            lr=cfg.lr,
            beta1=cfg.beta1,
            beta2=cfg.beta2,
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=False,
            maximize=False,
        )
    assert torchgraft.stats()[key("adamw")]["fallbacks"] == 1
    ref = adam_step_reference(before, float(lists[5][0]), cfg)
    torch.testing.assert_close(views[0][0], ref.param, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(views[2][0], ref.exp_avg, rtol=1e-12, atol=1e-14)
    for gap, lst in zip(gaps, lists[:4], strict=True):
        assert torch.equal(lst[0][1::2], gap)


@pytest.mark.parametrize("fused_cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_optim_fused_steps_unchanged(fused_cls, amsgrad):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    twin = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    twin.load_state_dict(model.state_dict())
    opts = [
        fused_cls(m.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=amsgrad, fused=True)
        for m in (model, twin)
    ]
    x = torch.randn(8, 17)
    for step in range(3):
        for i, (m, opt) in enumerate(zip((model, twin), opts, strict=True)):
            ctx = (
                torchgraft.enabled()
                if i == 1
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            )
            with ctx:
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"
    op = "adamw" if fused_cls is torch.optim.AdamW else "adam"
    assert calls(key(op)) + calls(key(op, "tensor_lr")) == 3


def test_found_inf_skips_the_step_and_grad_scale_unscales():
    lists = make_lists([40], torch.float32, False)
    ours = clone(lists)
    with torchgraft.enabled():
        torch._fused_adamw_(
            *ours,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
            grad_scale=torch.tensor(8.0),
            found_inf=torch.tensor(1.0),
        )
    assert_bitwise(ours, lists)
    with torchgraft.enabled():
        torch._fused_adamw_(
            *ours,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
            grad_scale=torch.tensor(8.0),
            found_inf=torch.tensor(0.0),
        )
    assert torch.equal(ours[1][0], lists[1][0] / 8.0)


def test_empty_tensors_and_lists():
    lists = make_lists([0, 5, 0], torch.float32, True)
    theirs, ours = clone(lists), clone(lists)
    run("adam", theirs, True, VARIANTS["plain"])
    with torchgraft.enabled():
        run("adam", ours, True, VARIANTS["plain"])
    assert_bitwise(ours, theirs)


def _error_of(fn) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value).split("\n")[0]


def _call_with(**change):
    lists = make_lists([5], torch.float32, change.pop("amsgrad_lists", False))
    names = ["params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"]
    args = dict(zip(names, lists, strict=True))
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8)
    kwargs.update(amsgrad=False, maximize=False)
    for k, v in change.items():
        (args if k in names else kwargs)[k] = v
    return lambda: torch._fused_adamw_(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "change",
    [
        dict(grads=[]),
        dict(exp_avgs=[torch.randn(5), torch.randn(5)]),
        dict(state_steps=[]),
        dict(max_exp_avg_sqs=[torch.rand(5)]),
        dict(amsgrad=True),
        dict(grads=[torch.randn(5, dtype=torch.float64)]),
        dict(exp_avg_sqs=[torch.rand(5, dtype=torch.bfloat16)]),
        dict(
            params=[torch.arange(5)],
            grads=[torch.arange(5)],
            exp_avgs=[torch.arange(5)],
            exp_avg_sqs=[torch.arange(5)],
        ),
        dict(state_steps=[torch.tensor([1.0, 2.0])]),
        dict(lr=torch.tensor([1e-3, 1.0])),
        dict(grad_scale=torch.tensor(2.0, dtype=torch.float64)),
        dict(found_inf=torch.tensor(0.0, dtype=torch.float64)),
    ],
    ids=lambda c: ",".join(c),
)
def test_errors_like_aten(change):
    theirs = _error_of(_call_with(**change))
    with torchgraft.enabled():
        ours = _error_of(_call_with(**change))
    assert issubclass(ours[0], RuntimeError) and issubclass(theirs[0], RuntimeError)
    # ATen appends advice to some messages; ours carry the same first sentence.
    assert theirs[1].startswith(ours[1].rstrip(".").split(" (")[0][:40]), (ours, theirs)


def test_mismatched_sizes_are_an_error():
    # ATen would read past the smaller buffer; the graft refuses.
    with (
        torchgraft.enabled(),
        pytest.raises(RuntimeError, match=r"grads has 4 elements but params has"),
    ):
        _call_with(grads=[torch.randn(4)])()


def test_disable_restores_aten_and_grafts_are_listed():
    lists = make_lists([9], torch.float32, False)
    with torchgraft.enabled():
        run("adamw", clone(lists), False, VARIANTS["plain"])
        rows = {(r["op"], r["dispatch_key"]) for r in list_rows()}
    assert calls(key("adamw")) == 1
    run("adamw", clone(lists), False, VARIANTS["plain"])
    assert calls(key("adamw")) == 1
    for op in (
        "_fused_adamw_",
        "_fused_adamw_.tensor_lr",
        "_fused_adam_",
        "_fused_adam_.tensor_lr",
    ):
        assert (f"aten::{op}", "CPU") in rows
        assert (f"aten::{op}", "CUDA") in rows


def test_compiled_optimizer_step_runs_the_graft():
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    x = torch.randn(4, 16)
    for m in models:
        m(x).square().sum().backward()
    opts[0].step()
    with torchgraft.enabled():
        torch.compile(opts[1].step, backend="aot_eager")()
    assert calls(key("adamw")) + calls(key("adamw", "tensor_lr")) >= 1
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
