"""``torchgraft bench <op>`` for the fused ops: swiglu, geglu, rope, cross_entropy,
linear_cross_entropy (issue 13).

On the CPU: each op's ``--quick`` run exits 0 and its JSON has every route that can run here,
checked against float64 within the tolerance, the torchgraft route's grafts counted; a wrong
route goes through the harness's check like rms_norm's (reported, not timed, exit 1). The CUDA
paths (Liger, extra peak memory) run on the GPU machine; here only their formatting is tested.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import torchgraft
from torchgraft import cli, native
from torchgraft.bench import cross_entropy, geglu, harness, linear_cross_entropy, rope, swiglu
from torchgraft.bench.routes import Route
from torchgraft.bench.table import format_markdown, format_terminal
from torchgraft.bench.timing import extra_peak_bytes

pytestmark = pytest.mark.default_torch

PYTHON_DIR = str(Path(torchgraft.__file__).resolve().parents[1])
CPU = torch.device("cpu")
NEW_OPS: list[ModuleType] = [swiglu, geglu, rope, cross_entropy, linear_cross_entropy]
INTERFACE = (
    "OP",
    "MODES",
    "TOLERANCE",
    "BASELINE",
    "PEAK_MEMORY",
    "Problem",
    "default_shapes",
    "default_dtype",
    "check_shape",
    "bytes_moved",
    "make_inputs",
    "reference",
    "run_once",
    "timed_call",
    "routes",
)


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    yield
    torchgraft.disable()


def _ids(op: ModuleType) -> str:
    return op.OP


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m torchgraft ARGS`` with this checkout's package first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "torchgraft", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("op", NEW_OPS, ids=_ids)
def test_op_module_has_the_harness_interface(op):
    assert harness.OPS[op.OP] is op
    for name in INTERFACE:
        assert hasattr(op, name), f"{op.OP} lacks {name}"
    assert op.BASELINE in {r.name for r in op.routes()}
    for device in (CPU, torch.device("cuda")):
        for quick in (True, False):
            for shape in op.default_shapes(device, quick):
                assert op.check_shape(shape) is None, (op.OP, shape)
    # Random inputs, not zeros, and a float64 reference per result of each mode.
    problem = op.Problem(op.default_shapes(CPU, True)[0], torch.float32, CPU)
    inputs = op.make_inputs(problem)
    assert inputs.x.float().std() > 0.05  # random values (the lm-head weight is scaled)
    for mode in op.MODES:
        assert all(r.dtype == torch.float64 for r in op.reference(inputs, mode))
        assert op.bytes_moved(problem, mode) > 0


def _runnable_on_cpu(op: ModuleType) -> set[str]:
    """The routes a --quick CPU run times: those that can run here, torch.compile left out."""
    return {r.name for r in op.routes() if r.unavailable(CPU) is None and r.name != "compile"}


@pytest.mark.parametrize("op", NEW_OPS, ids=_ids)
def test_bench_quick_cpu_checks_every_route_and_counts_grafts(op, tmp_path):
    result = run_cli(
        "bench", op.OP, "--device", "cpu", "--quick", "--no-plot", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    stem = f"{op.OP}_cpu_fp32"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.md"]
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["op"] == op.OP
    assert data["baseline"] == op.BASELINE
    shapes = ["x".join(map(str, s)) for s in op.default_shapes(CPU, True)]
    assert data["shapes"] == shapes
    assert data["modes"] == list(op.MODES)

    timed = {m["route"] for m in data["measurements"]}
    assert timed == _runnable_on_cpu(op)
    assert "eager" in timed
    if native.available():
        assert "torchgraft" in timed
    for route in timed:
        got = {(m["shape"], m["mode"]) for m in data["measurements"] if m["route"] == route}
        assert got == {(s, mode) for s in shapes for mode in op.MODES}, route
    tolerance = op.TOLERANCE[torch.float32]
    for m in data["measurements"]:
        assert 0 <= m["rel_err"] <= tolerance, m
        assert m["median_ms"] > 0
        assert m["extra_peak_bytes"] is None  # measured on CUDA only
        if m["route"].startswith("torchgraft"):
            # One checked call ran torchgraft's own operator (forward, and backward in fwd+bwd).
            assert m["grafted"] is True, m
            assert m["grafts"], m
            assert all(key.startswith("native/torchgraft::") for key in m["grafts"]), m
            assert any(key.endswith("/CPU") and v["calls"] > 0 for key, v in m["grafts"].items())
        else:
            assert m["grafts"] is None and m["grafted"] is None
    # Ops that give PASSES have a memory floor per shape and mode, of the bytes the mode moves.
    floors = {(f["shape"], f["mode"]): f for f in data["floors"]}
    if not hasattr(op, "PASSES"):
        assert floors == {}
    else:
        assert set(floors) == {(s, mode) for s in shapes for mode in op.MODES}
        for shape in op.default_shapes(CPU, True):
            problem = op.Problem(shape, torch.float32, CPU)
            for mode in op.MODES:
                floor = floors["x".join(map(str, shape)), mode]
                assert floor["route"] == "floor"
                assert floor["bytes"] == op.bytes_moved(problem, mode)
                assert floor["median_ms"] > 0
        assert "floor: the memory floor" in result.stdout
    # Routes left out are in the JSON with their reason, and printed.
    skipped = {r["name"]: r["skipped"] for r in data["routes"] if r["skipped"]}
    assert "--quick" in skipped["compile"]
    assert "liger" in skipped
    for name, reason in skipped.items():
        assert f"{name}: {reason}" in result.stdout
    assert f"speedup vs {op.BASELINE}" in result.stdout


def _wrong_route(op: ModuleType) -> Callable[[], tuple[Route, ...]]:
    """``op.routes`` plus ``wrong``: the eager route's results (and so its gradients) scaled."""
    original = op.routes

    def build(problem: Any) -> Callable[..., Any]:
        eager = next(r for r in original() if r.name == "eager").build(problem)

        def wrong(*args: torch.Tensor) -> Any:
            out = eager(*args)
            return tuple(t * 1.5 for t in out) if isinstance(out, tuple) else out * 1.5

        return wrong

    def routes() -> tuple[Route, ...]:
        first = original()[0]
        return (*original(), Route("wrong", "scaled", lambda _d: None, build, first.dispatch))

    return routes


@pytest.mark.parametrize("op", NEW_OPS, ids=_ids)
def test_wrong_route_is_reported_not_timed_and_exits_1(op, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(op, "routes", _wrong_route(op))
    code = cli.main(
        [
            "bench",
            op.OP,
            "--device",
            "cpu",
            "--quick",
            "--routes",
            "eager,wrong",
            "--out",
            str(tmp_path),
            "--no-plot",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err
    data = json.loads((tmp_path / f"{op.OP}_cpu_fp32.json").read_text())
    assert {m["route"] for m in data["measurements"]} == {"eager"}
    wrong = [s for s in data["skips"] if s["route"] == "wrong"]
    assert len(wrong) == len(data["shapes"]) * len(data["modes"])
    assert all(s["reason"].startswith("wrong result: relative error") for s in wrong)
    assert re.search(r"^wrong(\s+wrong)+$", captured.out, re.MULTILINE)


@pytest.mark.parametrize(
    ("op", "shapes", "fragment"),
    [
        ("rope", "2x64x8x128", "expected batch x seq x heads x kv_heads x dim"),
        ("rope", "2x64x8x2x63", "the head dim must be even"),
        ("cross_entropy", "8x16x1000", "expected rows x vocab"),
        ("linear_cross_entropy", "64x1000", "expected tokens x hidden x vocab"),
    ],
)
def test_shape_that_does_not_fit_the_op_exits_2(op, shapes, fragment, capsys):
    code = cli.main(["bench", op, "--device", "cpu", "--shapes", shapes])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("torchgraft: error: bad --shapes entry")
    assert fragment in err


def test_extra_peak_memory_is_not_measured_off_cuda():
    assert extra_peak_bytes(lambda: torch.ones(1000), CPU) is None


def test_tables_show_extra_peak_memory_and_the_ops_baseline():
    report = harness.BenchReport(
        op="cross_entropy",
        device={"type": "cuda", "name": "Some GPU"},
        dtype="bfloat16",
        modes=["fwd+bwd"],
        shapes=["8x16"],
        routes=[{"name": n, "summary": "", "skipped": None} for n in ("eager", "liger")],
        versions={},
        timing="",
        quick=False,
        created="",
        baseline="eager",
    )
    report.measurements = [
        harness.Measurement("eager", "fwd+bwd", "8x16", 100, 2.0, 0.1, None, 0.0, None, 3 * 2**30),
        harness.Measurement("liger", "fwd+bwd", "8x16", 100, 1.0, 0.2, None, 0.0, None, 0),
    ]
    terminal = format_terminal(report)
    assert "speedup vs eager" in terminal
    assert re.search(r"^eager\s+2\.00 1\.00x \+3GiB$", terminal, re.MULTILINE)
    assert re.search(r"^liger\s+1\.00 2\.00x \+0B$", terminal, re.MULTILINE)
    assert "+N: extra peak memory of one call" in terminal
    markdown = format_markdown(report)
    assert "| 8x16 | 2.00 (1.00x) +3GiB | 1.00 (2.00x) +0B | - |" in markdown
    assert json.loads(json.dumps(report.to_json()))["measurements"][0]["extra_peak_bytes"] == (
        3 * 2**30
    )


def test_floor_call_moves_the_bytes_in_one_copy_per_pass():
    moved, passes = 32_000, 2
    call = harness.floor_call(moved, passes, CPU)
    with torch.profiler.profile(record_shapes=True) as prof:
        call()
    copies = [e for e in prof.events() if e.name == "aten::copy_"]
    assert len(copies) == passes
    # Each copy reads and writes its float32 elements: together, `moved` bytes.
    assert sum(2 * 4 * e.input_shapes[0][0] for e in copies) == moved


def test_floor_call_copies_large_passes_in_pieces(monkeypatch):
    monkeypatch.setattr(harness, "COPY_CHUNK_BYTES", 1000 * 4)
    moved, passes = 2 * 4 * 2500 * 2, 2  # 2500 float32 elements per pass
    call = harness.floor_call(moved, passes, CPU)
    with torch.profiler.profile(record_shapes=True) as prof:
        call()
    sizes = [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::copy_"]
    assert sizes == [1000, 1000, 500] * passes


@pytest.mark.parametrize("op", list(harness.OPS.values()), ids=_ids)
def test_every_route_passes_its_own_check_in_float64(op):
    # What `torchgraft bench <op> --dtype fp64` checks, without the timing: the float64
    # reference leaves the shared inputs alone (for float64 inputs `.double()` is the tensor
    # itself), and every route, the eager baselines included, computes in float64.
    problem = op.Problem(op.default_shapes(CPU, True)[0], torch.float64, CPU)
    inputs = op.make_inputs(problem)
    tolerance = op.TOLERANCE[torch.float64]
    for mode in op.MODES:
        reference = op.reference(inputs, mode)
        tensors = [v for v in vars(inputs).values() if isinstance(v, torch.Tensor)]
        assert not any(t.requires_grad for t in tensors), (op.OP, mode)
        for route in op.routes():
            if route.unavailable(CPU) is not None or route.name == "compile":
                continue
            with route.dispatch():
                outputs = op.run_once(route.build(problem), inputs, mode)
            for out, ref in zip(outputs, reference, strict=True):
                err = float((out.detach().double() - ref).norm() / ref.norm())
                assert err <= tolerance, (op.OP, route.name, mode, err)


def test_timings_report_their_spread_and_the_table_warns_when_it_passes_2x():
    # A loaded machine once printed "rope 934x" from one quick run with no sign of trouble.
    from torchgraft.bench import timing

    durations = iter([0.001, 0.004] * 1000)

    def uneven() -> None:
        t_end = time.perf_counter() + next(durations)
        while time.perf_counter() < t_end:
            pass

    measured = timing.measure(uneven, CPU, quick=True)
    assert measured.min_ms <= measured.median_ms <= measured.max_ms
    assert measured.max_ms > 3 * measured.min_ms and measured.spread > 3

    report = harness.BenchReport(
        op="rope",
        device={"name": "cpu"},
        dtype="float32",
        modes=["fwd"],
        shapes=["8x16"],
        routes=[{"name": r, "summary": "", "skipped": None} for r in ("eager", "torchgraft")],
        versions={},
        timing="",
        quick=True,
        created="",
        baseline="eager",
    )
    report.measurements = [
        harness.Measurement(
            "eager", "fwd", "8x16", 100, 93.4, 0.1, None, 0.0, None, None, 90.0, 95.0
        ),
        harness.Measurement(
            "torchgraft", "fwd", "8x16", 100, 0.1, 0.2, None, 0.0, None, None, 0.09, 2.5
        ),
    ]
    for text in (format_terminal(report), format_markdown(report)):
        assert "torchgraft 8x16 fwd: min 0.090, median 0.100, max 2.50 ms" in text
        assert "more than 2x" in text
    assert json.loads(json.dumps(report.to_json()))["measurements"][1]["max_ms"] == 2.5
    report.measurements[1] = dataclasses.replace(report.measurements[1], max_ms=0.15)
    assert "more than 2x" not in format_terminal(report)


def test_standalone_gpu_benchmarks_write_their_rows_and_table(tmp_path):
    from torchgraft.bench.results import write_rows

    meta = {"device": "NVIDIA H200", "torch": "2.15.0"}
    rows = [{"shape": "small", "aten device_ms": 0.5}]
    stem = write_rows(tmp_path / "out", "grouped_mm_cuda", meta, rows, "| a |\n")
    assert stem == tmp_path / "out" / "grouped_mm_cuda-h200"
    assert json.loads(stem.with_suffix(".json").read_text()) == {"meta": meta, "rows": rows}
    assert stem.with_suffix(".md").read_text() == "| a |\n"
