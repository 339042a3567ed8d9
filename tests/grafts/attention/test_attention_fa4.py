"""FA4 under the SDPA ops, on CPU: what the conds decline, the crossover table, and the impls'
outputs in ATen's format (checked against the ops' meta functions and ATen's own derivative
formulas), with an eager stand-in for FA4 (``fake_fa4_interface.py``)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from dsl_fakes import (
    clear_caches,
    write_dist,
    write_module,
)
from torchgraft import registry
from torchgraft.grafts.attention import attention_reference, crossover, support
from torchgraft.grafts.attention import fa4_cond as cond
from torchgraft.grafts.attention import fa4_impl as impl
from torchgraft.grafts.attention.crossover import Row, Table
from torchgraft.grafts.attention.support import Problem, problem_reason

pytestmark = [pytest.mark.default_torch, pytest.mark.usefixtures("clean_overrides")]

_aten = torch.ops.aten


def problem(**changes) -> Problem:
    base = {
        "capability": (9, 0),
        "dtype": torch.bfloat16,
        "batch": 2,
        "heads_q": 16,
        "heads_kv": 8,
        "seq_q": 2048,
        "seq_k": 2048,
        "head_dim": 128,
        "head_dim_v": 128,
        "causal": True,
    }
    base.update(changes)
    return Problem(**base)


# ---- what FA4 can compute ---------------------------------------------------------------------


def test_fa4_computes_the_supported_problems():
    for head_dim in sorted(support.HEAD_DIMS):
        for dtype in (torch.float16, torch.bfloat16):
            for capability in ((9, 0), (10, 0)):
                p = problem(head_dim=head_dim, head_dim_v=head_dim, dtype=dtype)
                assert problem_reason(p) is None
                assert problem_reason(Problem(**{**p.__dict__, "capability": capability})) is None
    assert problem_reason(problem(causal=False, seq_q=100, seq_k=300)) is None


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"capability": (8, 0)}, "not sm80"),
        ({"capability": (12, 0)}, "not sm120"),
        ({"dtype": torch.float32}, "not torch.float32"),
        ({"head_dim": 80, "head_dim_v": 80}, "head dims 80/80"),
        ({"head_dim": 256, "head_dim_v": 256}, "head dims 256/256"),
        ({"head_dim_v": 64}, "head dims 128/64"),
        ({"heads_q": 12, "heads_kv": 8}, "not a multiple"),
        ({"seq_q": 1024}, "causal with seq_q != seq_k"),
        ({"seq_q": 0}, "empty input"),
        ({"batch": 0}, "empty input"),
    ],
)
def test_fa4_declines_what_it_cannot_compute(changes, words):
    reason = problem_reason(problem(**changes))
    assert reason is not None and words in reason


def test_cpu_calls_are_declined_with_a_reason():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    assert support.decline_reason(q, q, q, False) == "not a CUDA device (cpu)"
    out = torch.empty_like(q)
    lse = torch.empty(1, 2, 16)
    seed = torch.empty(2, dtype=torch.uint64)
    assert not cond.flash_attention_cond(q, q, q, 0.0, True)
    assert not cond.flash_attention_backward_cond(
        out, q, q, q, out, lse, None, None, 16, 16, 0.0, True, seed, seed
    )
    assert not cond.cudnn_attention_cond(q, q, q, None, True, 0.0, True)
    assert not cond.cudnn_attention_backward_cond(
        out, q, q, q, out, lse.unsqueeze(-1), seed, seed, None, None, None, 16, 16, 0.0, True
    )


def test_dropout_masks_debug_masks_and_broken_imports_are_declined(monkeypatch):
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    assert cond.why_not("flash", "forward", q, q, q, True, 0.1) == "dropout"
    assert not cond.flash_attention_cond(q, q, q, 0.0, True, True)  # return_debug_mask
    assert not cond.cudnn_attention_cond(q, q, q, torch.zeros(16, 16), True, 0.0, False)
    monkeypatch.setattr(impl.FA4, "error", "ImportError: no libcuda")
    assert cond.why_not("cudnn", "forward", q, q, q, True, 0.0) == (
        "FA4 could not be imported (ImportError: no libcuda)"
    )


def test_layout_and_shape_problems_are_declined():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    assert support.layout_reason(q, q.transpose(2, 3)) == "last dim not contiguous"
    assert support.layout_reason(q, q.to("meta")) == "tensors on different devices"
    assert support.layout_reason(q, None, q.transpose(1, 2)) is None
    assert support.layout_reason(q, torch._lazy_clone(q)) == "copy-on-write input"
    k_other_batch = torch.randn(2, 2, 16, 64)
    assert Problem.of(q, k_other_batch, k_other_batch, False, (9, 0)) is None
    assert "head dims 64/32" in problem_reason(Problem.of(q, q, q[..., :32], False, (9, 0)))
    assert Problem.of(q, q[:, :, :8], q, False, (9, 0)) is None  # key and value seq differ
    assert Problem.of(q[0], q[0], q[0], False, (9, 0)) is None


# ---- the crossover table ----------------------------------------------------------------------


def rows(*seq_wins: tuple[int, bool, bool], baseline: str = "cudnn") -> tuple[Row, ...]:
    return tuple(
        Row("sm90", baseline, 128, True, True, seq, forward, backward)
        for seq, forward, backward in seq_wins
    )


def test_nearest_measured_length_decides():
    table = Table(rows((1024, False, False), (4096, True, False), (16384, True, True)))
    assert not table.wins("cudnn", "forward", problem(seq_q=1024, seq_k=1024))
    assert not table.wins("cudnn", "forward", problem(seq_q=1500, seq_k=1500))
    assert table.wins("cudnn", "forward", problem(seq_q=3000, seq_k=3000))
    assert not table.wins("cudnn", "backward", problem(seq_q=4096, seq_k=4096))
    assert table.wins("cudnn", "backward", problem(seq_q=12000, seq_k=12000))
    assert table.wins("cudnn", "backward", problem(seq_q=65536, seq_k=65536))
    # 2048 lies as far from 1024 as from 4096 (log scale): the shorter one decides.
    assert not table.wins("cudnn", "forward", problem(seq_q=2048, seq_k=2048))


def test_unmeasured_problems_stay_on_aten():
    table = Table(rows((4096, True, True)))
    assert table.wins("cudnn", "forward", problem(seq_q=4096, seq_k=4096))
    assert not table.wins("flash", "forward", problem(seq_q=4096, seq_k=4096))
    for changes in (
        {"capability": (10, 0)},
        {"head_dim": 64, "head_dim_v": 64},
        {"causal": False},
        {"heads_kv": 16},
    ):
        assert not table.wins("cudnn", "forward", problem(seq_q=4096, seq_k=4096, **changes))


def test_fixed_answers_and_overrides():
    p = problem()
    assert Table(mode="always").wins("flash", "backward", p)
    assert not Table(mode="never").wins("cudnn", "forward", p)
    with crossover.override("always"):
        assert crossover.wins("flash", "forward", p)
        with crossover.override("never"):
            assert not crossover.wins("flash", "forward", p)
        assert crossover.wins("flash", "forward", p)
        assert "every call" in crossover.summary()


def test_committed_table_is_well_formed():
    table = crossover.load_table()
    assert table.rows and table.mode == "table"
    data = json.loads(crossover.TABLE_PATH.read_text())
    assert len(data["rows"]) == len(table.rows)
    for row in table.rows:
        assert row.arch == "sm90" and row.baseline in ("cudnn", "flash")
        assert row.head_dim in support.HEAD_DIMS and row.seq > 0
    # The H100 sweep (bench/results/attention_fa4-h100.json): cuDNN's kernels won both passes
    # at B16 S1024 16/8 heads d128 causal, FA4 won both from S4096 up.
    assert not table.wins("cudnn", "forward", problem(seq_q=1024, seq_k=1024))
    assert not table.wins("cudnn", "backward", problem(seq_q=1024, seq_k=1024))
    assert table.wins("cudnn", "forward", problem(seq_q=8192, seq_k=8192))
    assert table.wins("cudnn", "backward", problem(heads_kv=16, seq_q=8192, seq_k=8192))


def test_bad_table_files_mean_no_fa4(tmp_path, caplog):
    bad = tmp_path / "table.json"
    bad.write_text('{"rows": [{"arch": "sm90"}]}')
    with caplog.at_level(logging.WARNING):
        table = crossover.load_table(bad)
    assert table.rows == () and not table.wins("cudnn", "forward", problem())
    assert "unusable" in caplog.text
    assert crossover.load_table(tmp_path / "missing.json").rows == ()


def test_environment_names_the_table(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"rows": [Row("sm90", "flash", 64, False, False, 1024, True, True).__dict__]})
    )
    try:
        for value, expected in ((str(path), 1), ("always", 0), ("never", 0)):
            monkeypatch.setenv(crossover.CROSSOVER_ENV, value)
            crossover.reload()
            table = crossover.current()
            assert len(table.rows) == expected
            assert table.mode == ("table" if value == str(path) else value)
    finally:
        monkeypatch.delenv(crossover.CROSSOVER_ENV)
        crossover.reload()
    assert crossover.current().source == str(crossover.TABLE_PATH)


# ---- the impls, with an eager stand-in for FA4 -----------------------------------------------


@pytest.fixture
def fake_fa4(fake_root):
    """flash_attn.cute.interface = fake_fa4_interface.py; FA4 imported afresh."""
    write_dist(fake_root, "flash-attn-4", "4.0.0b36")
    write_module(fake_root, "flash_attn", "")
    write_module(fake_root, "flash_attn.cute", "")
    shutil.copy(
        Path(__file__).resolve().parents[2] / "fake_fa4_interface.py",
        fake_root / "flash_attn" / "cute" / "interface.py",
    )
    clear_caches()
    impl.FA4.reset()
    module = impl.FA4.get()
    assert module is not None, impl.FA4.error
    from flash_attn.cute import interface

    interface.CALLS.update(fwd=0, bwd=0)
    return interface


def inputs(batch=2, heads=4, heads_kv=2, seq=24, dim=64, *, bshd=True, dtype=torch.bfloat16):
    """q, k, v as models make them: (batch, seq, heads, dim) transposed to SDPA's layout."""

    def make(h: int) -> torch.Tensor:
        if bshd:
            return torch.randn(batch, seq, h, dim, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, h, seq, dim, dtype=dtype)

    return make(heads), make(heads_kv), make(heads_kv)


def meta_of(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def assert_like(ours: object, meta: object, *, what: str) -> None:
    if isinstance(meta, torch.Tensor) and meta.device.type == "meta":
        assert isinstance(ours, torch.Tensor), what
        assert ours.shape == meta.shape and ours.dtype == meta.dtype, what
        if ours.numel() > 1:
            assert ours.stride() == meta.stride(), what
    else:
        assert ours == meta, what


@pytest.mark.parametrize("bshd", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_impl_matches_the_meta_function_and_the_reference(fake_fa4, bshd, causal):
    q, k, v = inputs(bshd=bshd)
    ours = impl.flash_attention_impl(q, k, v, 0.0, causal, scale=0.2)
    meta = _aten._scaled_dot_product_flash_attention.default(
        meta_of(q), meta_of(k), meta_of(v), 0.0, causal, scale=0.2
    )
    names = ("output", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "rng", "unused")
    for name, a, b in zip(names, ours, meta, strict=False):
        if b is None:
            assert a is None, name
        else:
            assert_like(a, b, what=name)
    assert ours[-1].numel() == 0 and ours[-1].dtype == q.dtype  # debug_attn_mask
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=causal, scale=0.2)
    assert rel_err(ours[0], ref_out) < 1e-2 and rel_err(ours[1], ref_lse) < 1e-5
    assert fake_fa4.CALLS["fwd"] == 1


@pytest.mark.parametrize("bshd", [True, False])
def test_cudnn_impl_matches_the_meta_function_and_the_reference(fake_fa4, bshd):
    q, k, v = inputs(bshd=bshd, heads_kv=4)
    ours = impl.cudnn_attention_impl(q, k, v, None, False, 0.0, True)
    meta = _aten._scaled_dot_product_cudnn_attention.default(
        meta_of(q), meta_of(k), meta_of(v), None, True, 0.0, True
    )
    for index in (0, 1):
        assert_like(ours[index], meta[index], what=f"return {index}")
    assert ours[2] is None and ours[3] is None and ours[8] is None
    assert (ours[4], ours[5]) == (q.shape[2], k.shape[2])
    for seed, meta_seed in zip(ours[6:8], meta[6:8], strict=True):
        assert seed.dtype == torch.int64 and seed.shape == meta_seed.shape and int(seed) == 0
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=True)
    assert rel_err(ours[0], ref_out) < 1e-2 and rel_err(ours[1].squeeze(-1), ref_lse) < 1e-5


def _register_at_cpu(op: str, op_impl: object, op_cond: object = None) -> None:
    # The SDPA ops have no CPU kernel; at CPU the impls can still run under ATen's autograd.
    take = op_cond if op_cond is not None else (lambda *a, **k: True)
    registry.register_op_override("cutedsl", "aten", op, "CPU", take, op_impl)


def _attn_bias_seen(seen: list[object]) -> object:
    def record(*args: object, **kwargs: object) -> bool:
        seen.append(args[8])  # attn_bias, as the backward's cond receives it
        return True

    return record


@pytest.mark.parametrize("kind", ["flash", "cudnn"])
@pytest.mark.parametrize(("heads_kv", "causal"), [(4, True), (2, False), (1, True)])
def test_aten_autograd_runs_the_impls_and_gets_the_reference_gradients(
    fake_fa4, kind, heads_kv, causal
):
    seen: list[object] = []
    if kind == "flash":
        _register_at_cpu("_scaled_dot_product_flash_attention", impl.flash_attention_impl)
        _register_at_cpu(
            "_scaled_dot_product_flash_attention_backward", impl.flash_attention_backward_impl
        )
    else:
        _register_at_cpu("_scaled_dot_product_cudnn_attention", impl.cudnn_attention_impl)
        _register_at_cpu(
            "_scaled_dot_product_cudnn_attention_backward",
            impl.cudnn_attention_backward_impl,
            _attn_bias_seen(seen),
        )
    q, k, v = (t.detach().requires_grad_() for t in inputs(heads_kv=heads_kv, dtype=torch.float16))
    if kind == "flash":
        out = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
    else:
        out = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[0]
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, is_causal=causal)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    assert rel_err(out, ref) < 2e-3
    for ours, want, like in ((dq, rq, q), (dk, rk, k), (dv, rv, v)):
        assert ours.shape == like.shape and ours.stride() == like.stride()
        assert rel_err(ours, want) < 5e-3
    assert fake_fa4.CALLS == {"fwd": 1, "bwd": 1}
    # ATen's derivative formula passes "no bias" as an undefined tensor: None to the cond.
    assert seen == ([None] if kind == "cudnn" else [])


def test_torch_compile_plans_with_the_meta_functions_and_runs_the_impls(fake_fa4):
    # Inductor calls the op as an extern kernel, checks its outputs' sizes and strides against
    # the meta function's, and runs ATen's derivative formula: the impls must fit all three.
    _register_at_cpu("_scaled_dot_product_flash_attention", impl.flash_attention_impl)
    _register_at_cpu(
        "_scaled_dot_product_flash_attention_backward", impl.flash_attention_backward_impl
    )

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return (out * 2.0).sum(dim=1)

    q, k, v = (t.detach().requires_grad_() for t in inputs(heads_kv=2))
    compiled = torch.compile(attention, backend="inductor", fullgraph=True, dynamic=False)
    out = compiled(q, k, v)
    out.float().square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = (attention_reference(q64, k64, v64, is_causal=True)[0] * 2.0).sum(dim=1)
    ref.square().sum().backward()
    assert rel_err(out, ref) < 1e-2
    for ours, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel_err(ours, want) < 2e-2
    assert fake_fa4.CALLS == {"fwd": 1, "bwd": 1}


def test_the_benchmark_writes_rows_the_conds_read(tmp_path, monkeypatch):
    # bench/attention_fa4.py turns timings into crossover rows; the committed table is its output.
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / "attention_fa4.py"
    spec = importlib.util.spec_from_file_location("attention_fa4_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    problems = bench.problems()
    assert len(problems) == 40 and problems[0].causal and problems[0].head_dim == 128
    fast, slow = problems[0], problems[1]
    fast.ms = {"cudnn": {"fwd": 1.0, "fwd_bwd": 3.0}, "fa4": {"fwd": 0.8, "fwd_bwd": 2.9}}
    slow.ms = {"flash": {"fwd": 1.0, "fwd_bwd": 3.0}, "fa4": {"fwd": 0.99, "fwd_bwd": 2.5}}
    rows = bench.crossover_rows([fast, slow], "sm90")
    out = tmp_path / "crossover.json"
    out.write_text(json.dumps({"rows": rows}))
    table = crossover.load_table(out)
    p_fast = problem(heads_kv=8, seq_q=fast.seq, seq_k=fast.seq)
    assert table.wins("cudnn", "forward", p_fast)  # 0.8 vs 1.0
    assert not table.wins("cudnn", "backward", p_fast)  # 2.1 vs 2.0
    p_slow = problem(heads_kv=8, seq_q=slow.seq, seq_k=slow.seq)
    assert not table.wins("flash", "forward", p_slow)  # within the 2% margin
    assert table.wins("flash", "backward", p_slow)  # 1.51 vs 2.0


def test_a_call_fa4_refuses_goes_to_aten(fake_fa4, monkeypatch, caplog):
    # FA4's own checks raise AssertionError; the impl passes the call on to ATen's kernel (here,
    # on CPU, the dispatcher then reports that ATen has none).
    def refuse(*args, **kwargs):
        raise AssertionError("head_dim not supported")

    monkeypatch.setattr(fake_fa4, "_flash_attn_fwd", refuse)
    q, k, v = inputs()
    with caplog.at_level(logging.WARNING), pytest.raises(NotImplementedError, match="CPU"):
        impl.flash_attention_impl(q, k, v, 0.0, True)
    assert "FA4 refused a forward its cond accepted" in caplog.text
    assert not impl.FA4.failed  # one refusal is not a broken install
