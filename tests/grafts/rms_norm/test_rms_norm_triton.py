"""The Triton RMSNorm kernels on CPU tensors under TRITON_INTERPRET=1, against the float64
reference; and the aten graft's impls, conds and registration wiring.

Without a GPU, tests/conftest.py turns on Triton's interpreter (before triton is imported).
On a GPU machine the kernel tests here need TRITON_INTERPRET=1 set by the caller; without it
they skip and tests/grafts/rms_norm/test_rms_norm_triton_cuda.py covers the kernels on the GPU.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchgraft.grafts.rms_norm import registration, rms_norm_backward_reference, rms_norm_reference
from torchgraft.grafts.rms_norm import triton_cond as cond
from torchgraft.grafts.rms_norm import triton_crossover as crossover
from torchgraft.grafts.rms_norm import triton_impl as impl

pytestmark = pytest.mark.default_torch

tk = pytest.importorskip("torchgraft.grafts.rms_norm.triton_kernels")

INTERPRETED = type(tk._rms_norm_fwd_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="Triton kernels are compiled for the GPU in this process"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# ||out - ref|| / ||ref|| bounds per dtype. The interpreter truncates float32 -> bfloat16
# (the GPU rounds to nearest), so bf16 sees up to a full ulp: still well under 1e-2.
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
HIDDEN = [1, 3, 64, 100, 1000]
ROWS = [1, 5, 33]


def rel_err(out, ref, scale=None):
    """Relative-norm error; ``scale`` bounds the denominator from below."""
    den = ref.double().norm()
    if scale is not None:
        den = torch.maximum(den, scale.double().norm())
    return ((out.double() - ref.double()).norm() / den).item()


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def nan_like(t, dtype=None):
    return torch.full_like(t, float("nan"), dtype=dtype or t.dtype)


def run_forward(x, w, eps, config=None):
    """Launches the forward on NaN-poisoned outputs; returns (y, rstd)."""
    y = nan_like(x)
    rstd = torch.full((x.shape[0],), float("nan"), dtype=acc_dtype(x.dtype))
    tk.rms_norm_forward(x, w, eps, y, rstd, config=config)
    return y, rstd


def run_backward(dy, x, rstd, w, want_dx=True, want_dw=True, config=None, num_programs=None):
    """Launches the backward on NaN-poisoned outputs and partials; returns (dx, dw)."""
    dx = nan_like(x) if want_dx else None
    dw = nan_like(w) if want_dw and w is not None else None
    cfg = config or tk.backward_config(x.shape[1], x.dtype)
    programs = num_programs or tk.backward_num_programs(x.shape[0], cfg, x.device)
    partials = torch.full((programs, x.shape[1]), float("nan"), dtype=acc_dtype(x.dtype))
    tk.rms_norm_backward(dy, x, rstd, w, dx, dw, cfg, programs, partials)
    return dx, dw


def check_forward(x, w, eps, y, rstd):
    y_ref, rstd_ref = rms_norm_reference(x, [x.shape[1]], w, eps)
    assert not y.isnan().any() and not rstd.isnan().any()
    assert rel_err(y, y_ref) < TOL[x.dtype]
    assert rel_err(rstd, rstd_ref.flatten()) < TOL[acc_dtype(x.dtype)]


def check_backward(dy, x, w, eps, dx, dw):
    n = x.shape[1]
    _, rstd_ref = rms_norm_reference(x, [n], w, eps)
    dx_ref, dw_ref = rms_norm_backward_reference(dy, x, [n], rstd_ref, w)
    tol = TOL[x.dtype]
    if dx is not None:
        assert not dx.isnan().any()
        # dx = (g - xhat * mean(g * xhat)) * rstd cancels (exactly so for hidden 1): measure
        # the error against the size of the terms, g * rstd.
        g = dy.double() * (w.double() if w is not None else 1.0)
        assert rel_err(dx, dx_ref, scale=g * rstd_ref) < tol
    if dw is not None:
        assert not dw.isnan().any()
        # dw sums dy * xhat over rows; with few rows the sum can cancel too: measure against
        # the sum of the terms' sizes.
        xhat = x.double() * rstd_ref.double()
        assert rel_err(dw, dw_ref, scale=(dy.double() * xhat).abs().sum(0)) < tol


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_weight", [True, False])
def test_forward_and_backward_match_reference(dtype, n, rows, with_weight):
    x = torch.randn(rows, n, dtype=dtype)
    dy = torch.randn(rows, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype) if with_weight else None
    y, rstd = run_forward(x, w, 1e-6)
    check_forward(x, w, 1e-6, y, rstd)
    dx, dw = run_backward(dy, x, rstd, w)
    check_backward(dy, x, w, 1e-6, dx, dw)


FWD_CHUNKED = [tk.ForwardConfig(16, 1, 1, False), tk.ForwardConfig(64, 4, 2, False)]
BWD_CHUNKED = [tk.BackwardConfig(16, 1, 1, False, 1), tk.BackwardConfig(64, 4, 2, False, 2)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize(("n", "cfg"), [(3, 0), (100, 0), (100, 1), (1000, 1)])
def test_chunked_paths_match_reference(dtype, n, cfg):
    # Rows wider than the block: the kernels loop over chunks (the path for hidden > 16384
    # forward, > 8192 backward on the GPU), here forced with small blocks.
    rows = 9
    x = torch.randn(rows, n, dtype=dtype)
    dy = torch.randn(rows, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    y, rstd = run_forward(x, w, 1e-5, FWD_CHUNKED[cfg])
    check_forward(x, w, 1e-5, y, rstd)
    dx, dw = run_backward(dy, x, rstd, w, config=BWD_CHUNKED[cfg])
    check_backward(dy, x, w, 1e-5, dx, dw)
    dx, _ = run_backward(dy, x, rstd, None, config=BWD_CHUNKED[cfg])
    check_backward(dy, x, None, 1e-5, dx, None)


@needs_interpreter
@pytest.mark.parametrize("n", [1, 64, 1000])
def test_float64_kernels(n):
    x = torch.randn(7, n, dtype=torch.float64)
    dy = torch.randn(7, n, dtype=torch.float64)
    w = torch.randn(n, dtype=torch.float64)
    y, rstd = run_forward(x, w, 1e-6)
    check_forward(x, w, 1e-6, y, rstd)
    dx, dw = run_backward(dy, x, rstd, w)
    check_backward(dy, x, w, 1e-6, dx, dw)


@needs_interpreter
@pytest.mark.parametrize("want", [(True, False), (False, True)])
@pytest.mark.parametrize("single_pass", [True, False])
def test_backward_computes_only_what_is_asked(want, single_pass):
    x = torch.randn(33, 100, dtype=torch.bfloat16)
    dy = torch.randn(33, 100, dtype=torch.bfloat16)
    w = torch.randn(100, dtype=torch.bfloat16)
    _, rstd = run_forward(x, w, 1e-6)
    cfg = None if single_pass else BWD_CHUNKED[1]
    dx, dw = run_backward(dy, x, rstd, w, *want, config=cfg)
    assert (dx is not None, dw is not None) == want
    check_backward(dy, x, w, 1e-6, dx, dw)


@needs_interpreter
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize(("n", "rows"), [(1, 5), (100, 33)])
def test_backward_with_and_without_prefetch(prefetch, n, rows):
    x = torch.randn(rows, n, dtype=torch.bfloat16)
    dy = torch.randn(rows, n, dtype=torch.bfloat16)
    w = torch.randn(n, dtype=torch.bfloat16)
    _, rstd = run_forward(x, w, 1e-6)
    base = tk.backward_config(n, x.dtype)
    cfg = tk.BackwardConfig(base.block_n, 2, base.num_warps, True, 2, prefetch=prefetch)
    dx, dw = run_backward(dy, x, rstd, w, config=cfg)
    check_backward(dy, x, w, 1e-6, dx, dw)


@needs_interpreter
@pytest.mark.parametrize("programs", [1, 3, 33])
def test_dw_is_deterministic_and_independent_of_grid_size_within_rounding(programs):
    x = torch.randn(33, 64, dtype=torch.float32)
    dy = torch.randn(33, 64, dtype=torch.float32)
    w = torch.randn(64, dtype=torch.float32)
    _, rstd = run_forward(x, w, 1e-6)
    first = run_backward(dy, x, rstd, w, num_programs=programs)
    second = run_backward(dy, x, rstd, w, num_programs=programs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    check_backward(dy, x, w, 1e-6, *first)


@needs_interpreter
def test_rows_beyond_the_last_tile_are_not_touched():
    # The outputs are views into larger NaN buffers: the kernels must write exactly the rows
    # and columns they own (and the masks keep them off the guard elements).
    n, rows = 100, 5
    x = torch.randn(rows, n, dtype=torch.float16)
    w = torch.randn(n, dtype=torch.float16)
    y_buf = torch.full((rows + 2, n), float("nan"), dtype=torch.float16)
    rstd_buf = torch.full((rows + 2,), float("nan"))
    tk.rms_norm_forward(x, w, 1e-6, y_buf[:rows], rstd_buf[:rows])
    check_forward(x, w, 1e-6, y_buf[:rows], rstd_buf[:rows])
    assert y_buf[rows:].isnan().all() and rstd_buf[rows:].isnan().all()


def test_configs():
    assert tk.forward_config(4096, torch.bfloat16) == tk.ForwardConfig(4096, 1, 8, True)
    assert tk.forward_config(16384, torch.float32).single_pass
    assert not tk.forward_config(16385, torch.bfloat16).single_pass
    assert tk.forward_config(64, torch.bfloat16).rows == 32
    assert tk.backward_config(8192, torch.bfloat16).single_pass
    assert not tk.backward_config(16384, torch.bfloat16).single_pass
    for n in (1, 3, 100, 5000, 100000):
        for cfg in (tk.forward_config(n, torch.float16), tk.backward_config(n, torch.float16)):
            assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.rows & (cfg.rows - 1) == 0
            assert cfg.block_n >= n or not cfg.single_pass


# --- the aten graft: impls (CPU under the interpreter), conds (fake CUDA tensors) ----------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_impls_return_what_aten_returns(dtype, eps):
    shape, normalized = (2, 3, 4, 5), [4, 5]
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(normalized, dtype=dtype)
    dy = torch.randn(shape, dtype=dtype)
    y, rstd = impl.fused_rms_norm_impl(x, normalized, w, eps)
    meta_y, meta_rstd = torch.ops.aten._fused_rms_norm(x.to("meta"), normalized, w.to("meta"), eps)
    for ours, meta in ((y, meta_y), (rstd, meta_rstd)):
        assert (ours.shape, ours.dtype, ours.stride()) == (meta.shape, meta.dtype, meta.stride())
    y_ref, rstd_ref = rms_norm_reference(x, normalized, w, eps)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(rstd, rstd_ref) < TOL[torch.float32]

    for mask in ([True, True], [True, False], [False, True], [False, False]):
        for weight in (w, None):
            got = impl.fused_rms_norm_backward_impl(dy, x, normalized, rstd, weight, mask)
            meta = torch.ops.aten._fused_rms_norm_backward(
                dy.to("meta"),
                x.to("meta"),
                normalized,
                rstd.to("meta"),
                weight.to("meta") if weight is not None else None,
                mask,
            )
            ref = rms_norm_backward_reference(dy, x, normalized, rstd_ref, weight, mask)
            for ours, m, r in zip(got, meta, ref, strict=True):
                assert (ours is None) == (m is None) == (r is None)
                if ours is not None:
                    assert (ours.shape, ours.dtype, ours.stride()) == (
                        m.shape,
                        m.dtype,
                        m.stride(),
                    )
                    assert rel_err(ours, r) < TOL[dtype]


def test_impl_rejects_a_shape_mismatch():
    with pytest.raises(RuntimeError, match="normalized_shape"):
        impl.fused_rms_norm_impl(torch.randn(3, 4), [5], None, None)


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


BIG = (8, 4096, 4096)  # 32768 rows of 4096: inside the measured gate


def test_cond_accepts_a_plain_large_problem():
    with FakeTensorMode():
        x, w = fake_cuda(*BIG), fake_cuda(4096)
        _, rstd = torch.ops.aten._fused_rms_norm(x, [4096], w, None)
        assert cond.fused_rms_norm_cond(x, [4096], w, 1e-6)
        assert cond.fused_rms_norm_cond(x, [4096], None, None)
        assert cond.fused_rms_norm_backward_cond(x, x, [4096], rstd, w, [True, True])
        assert cond.fused_rms_norm_backward_cond(x, x, [4096], rstd, None, [True, False])
        assert cond.fused_rms_norm_cond(fake_cuda(*BIG, dtype=torch.float32), [4096], None, None)


def test_cond_refuses_what_the_kernels_do_not_take():
    with FakeTensorMode():
        x = fake_cuda(*BIG)
        refused = {
            "cpu": (torch.empty(BIG, dtype=torch.bfloat16), [4096], None),
            "float64": (fake_cuda(*BIG, dtype=torch.float64), [4096], None),
            "shape mismatch": (x, [2048], None),
            "two trailing dims mismatch": (x, [512, 2048], None),
            "empty normalized_shape": (x, [], None),
            "too many dims": (fake_cuda(4096), [1, 4096], None),
            "weight dtype": (x, [4096], fake_cuda(4096, dtype=torch.float32)),
            "weight shape": (x, [4096], fake_cuda(2048)),
            "weight device": (x, [4096], torch.empty(4096, dtype=torch.bfloat16)),
            "weight not contiguous": (x, [4096], fake_cuda(8192)[::2]),
            "non-contiguous input": (fake_cuda(4096, 8, 512).transpose(0, 2), [4096], None),
            "empty input": (fake_cuda(0, 4096), [4096], None),
            "small": (fake_cuda(16, 4096), [4096], None),
            "narrow": (fake_cuda(65536, 64), [64], None),
            "too wide": (fake_cuda(4096, 32768), [32768], None),
            "unaligned rows": (fake_cuda(8192, 4095), [4095], None),
        }
        for why, (xx, shape, ww) in refused.items():
            assert not cond.fused_rms_norm_cond(xx, shape, ww, None), why


def test_backward_cond_checks_grad_and_rstd():
    with FakeTensorMode():
        x, w = fake_cuda(*BIG), fake_cuda(4096)
        rstd = torch.empty(8, 4096, 1, device="cuda")
        ok = cond.fused_rms_norm_backward_cond
        assert ok(x, x, [4096], rstd, w, [True, True])
        assert not ok(fake_cuda(*BIG, dtype=torch.float16), x, [4096], rstd, w, [True, True])
        assert not ok(fake_cuda(*BIG).transpose(1, 2), x, [4096], rstd, w, [True, True])
        assert not ok(x, x, [4096], rstd.double(), w, [True, True])
        assert not ok(x, x, [4096], rstd[:4], w, [True, True])
        assert not ok(x, x, [4096], rstd, fake_cuda(2048), [True, True])
        assert not ok(x, x, [4096], torch.empty(8, 4096, 1), w, [True, True])


def test_crossover_rule(monkeypatch):
    table = ((2048, None), (8192, 64), (16384, 1024))
    monkeypatch.setitem(crossover.FORWARD_MIN_ROWS, "16bit", table)
    wins = crossover.wins_forward
    assert not wins(torch.bfloat16, 2048, 10**6)  # None: never
    assert not wins(torch.bfloat16, 4096, 63) and wins(torch.bfloat16, 4096, 64)
    assert wins(torch.float16, 8192, 64) and not wins(torch.float16, 8200, 1023)
    assert wins(torch.float16, 16384, 1024) and not wins(torch.float16, 16400, 10**6)
    assert not wins(torch.bfloat16, 4100, 10**6)  # rows not 16-byte aligned
    assert not wins(torch.bfloat16, 1000, 10**6)  # under MIN_HIDDEN


def test_crossover_tables_are_ordered():
    for tables in (crossover.FORWARD_MIN_ROWS, crossover.BACKWARD_MIN_ROWS):
        for table in tables.values():
            bounds = [max_hidden for max_hidden, _ in table]
            assert bounds == sorted(bounds) and bounds[0] >= crossover.MIN_HIDDEN


# --- registration wiring and the lazy import -----------------------------------------------


def test_register_installs_both_ops_at_cuda_and_deregister_removes_only_them(clean_overrides):
    from torchgraft import registry

    def user_cond(*args):
        return False

    def user_impl(*args):
        raise AssertionError("never called")

    registry.register_op_override("user", "aten", "_fused_rms_norm", "CUDA", user_cond, user_impl)
    registration.register()
    registration.register()  # idempotent
    ours = [
        (o.op, o.dispatch_key, o.active) for o in registry.list_overrides() if o.dsl == "triton"
    ]
    assert ours == [
        ("aten::_fused_rms_norm", "CUDA", True),
        ("aten::_fused_rms_norm_backward", "CUDA", True),
    ]
    registration.deregister()
    left = [(o.dsl, o.op, o.active) for o in registry.list_overrides()]
    assert left == [("user", "aten::_fused_rms_norm", True)]


def test_importing_the_package_does_not_import_triton():
    code = (
        "import sys, torchgraft.grafts.rms_norm as m\n"
        "from torchgraft.grafts.rms_norm import registration, triton_cond, triton_crossover\n"
        "from torchgraft.grafts.rms_norm import triton_impl\n"
        "assert callable(m.register) and callable(triton_impl.fused_rms_norm_impl)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "m.rms_norm\n"
        "assert 'triton' in sys.modules\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
