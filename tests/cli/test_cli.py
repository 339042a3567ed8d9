"""The torchgraft command line: demo, bench, doctor, list; output, files and exit codes.

Runs on the CPU. Each subcommand runs once in a subprocess (``python -m torchgraft``, the way
users start it) and otherwise in-process through ``torchgraft.cli.main(argv)``.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import platform
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import torchgraft
from torchgraft import cli, control, native
from torchgraft.bench import harness
from torchgraft.bench import rms_norm as rms_norm_bench
from torchgraft.bench import routes as bench_routes
from torchgraft.bench.progress import Progress
from torchgraft.bench.routes import Route
from torchgraft.bench.table import format_terminal
from torchgraft.registry import torch_native

pytestmark = pytest.mark.default_torch

PYTHON_DIR = str(Path(torchgraft.__file__).resolve().parents[1])
NATIVE = pytest.mark.skipif(not native.available(), reason="torchgraft._native is not built")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _clean_state():
    torchgraft.disable()
    torchgraft.reset_stats()
    threads = torch.get_num_threads()
    yield
    torchgraft.disable()
    torch.set_num_threads(threads)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m torchgraft ARGS`` with this checkout's package first on the path."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (PYTHON_DIR, os.environ.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", "torchgraft", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        check=False,
    )


def assert_usage_error(code: int, stderr: str, *fragments: str) -> None:
    """Exit status 2 and exactly one line on stderr, naming the problem, no traceback."""
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("torchgraft: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def graft_keys(dispatch_key: str) -> list[str]:
    """The stats keys of this build's native RMSNorm grafts for one dispatch key."""
    return [
        f"native/{g.op}/{g.dispatch_key}"
        for g in native.grafts()
        if g.dispatch_key == dispatch_key and "rms_norm" in g.op
    ]


# ---- demo ------------------------------------------------------------------------------------


@NATIVE
@pytest.mark.slow
def test_block_demo_subprocess_passes_and_prints_graft_counts():
    result = run_cli("demo", "--block", "--device", "cpu", "--rounds", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "PASS" in out
    # The block has two nn.RMSNorm: one forward + backward calls each graft twice.
    blocks = sum(isinstance(m, torch.nn.RMSNorm) for m in _demo_block().modules())
    for key in graft_keys("CPU"):
        match = re.search(rf"^\s+{re.escape(key)}\s+(\d+)", out, re.MULTILINE)
        assert match is not None, out
        assert int(match.group(1)) == blocks
    for what in ("output", "input gradient", "weight gradients"):
        assert re.search(rf"^\s+{what}.*max \|diff\| \S+\s+rel \S+\s+ok$", out, re.MULTILINE), out
    assert re.search(r"block forward \+ backward\s+stock\s+[\d.]+ ms.*speedup [\d.]+x", out)


def _demo_block() -> torch.nn.Module:
    from torchgraft.demo.block import CPU_SIZE, LlamaBlock

    return LlamaBlock(CPU_SIZE.dim, CPU_SIZE.heads, CPU_SIZE.hidden)


def test_block_demo_fails_with_reason_when_nothing_is_grafted(monkeypatch, capsys):
    monkeypatch.setenv(control.DISABLE_ENV, "1")
    assert cli.main(["demo", "--block", "--device", "cpu", "--rounds", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: no graft ran" in out
    assert f"{control.DISABLE_ENV} is set" in out


@NATIVE
@pytest.mark.slow
def test_block_demo_fails_when_results_differ_beyond_tolerance(monkeypatch, capsys):
    from torchgraft.demo import block

    # A negative tolerance no difference can meet: the FAIL branch and its exit status.
    monkeypatch.setitem(block.TOLERANCE, torch.float32, -1.0)
    assert cli.main(["demo", "--block", "--device", "cpu", "--rounds", "1"]) == 1
    out = capsys.readouterr().out
    assert "TOO LARGE" in out
    assert out.rstrip().endswith("beyond the tolerance.")


def test_demo_block_matches_float64_block():
    """The demo's model is a correct block: float32 stock vs the same block in float64."""
    from torchgraft.demo.block import CPU_SIZE, build_block, compare, make_step

    size = CPU_SIZE
    b32 = build_block(size, torch.device("cpu"), torch.float32)
    b64 = build_block(size, torch.device("cpu"), torch.float64)
    r32 = make_step(b32, size, torch.device("cpu"), torch.float32)()
    r64 = make_step(b64, size, torch.device("cpu"), torch.float64)()
    for d in compare(r32, r64):
        assert d.rel < 1e-5, d


TINY_MODEL_DEMO = ("demo", "--device", "cpu", "--size", "tiny", "--rounds", "1", "--steps", "1")


@NATIVE
@pytest.mark.slow
def test_model_demo_subprocess_passes_quietly_with_table_speed_and_ops():
    pytest.importorskip("transformers")
    from torchgraft.demo.model import TOLERANCE

    result = run_cli(*TINY_MODEL_DEMO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # no profiler or library noise
    out = result.stdout
    assert re.search(r"^torchgraft\.adopt: [1-9]\d* of \d+ layers adopted$", out, re.M), out
    for kind in ("rms_norm", "gated_mlp", "rope", "causal_lm_head"):
        assert re.search(rf"^{kind}\s+\S+\s+\d+\s+adopted\s", out, re.M), out
    passed = re.search(r"^  max relative difference (\S+): PASS$", out, re.M)
    assert passed is not None, out
    assert float(passed.group(1)) <= TOLERANCE[torch.float32]
    assert re.search(r"stock\s+[\d.]+ ms\s+torchgraft\s+[\d.]+ ms\s+speedup [\d.]+x", out)
    for model in ("stock", "torchgraft"):
        # Rows of the section (the first may be an autograd node when the host hiccups).
        section = re.search(rf"^Top 6 ops, {model} \(self CPU time.*\n((?:    .*\n)+)", out, re.M)
        assert section is not None and "    aten::" in section.group(1), out
    assert out.rstrip().endswith("within tolerance.")


@NATIVE
@pytest.mark.slow
def test_model_demo_fails_when_gradients_differ_beyond_tolerance(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from torchgraft.demo import model

    # A negative tolerance no difference can meet: the FAIL branch and its exit status.
    monkeypatch.setitem(model.TOLERANCE, torch.float32, -1.0)
    assert cli.main(list(TINY_MODEL_DEMO)) == 1
    out = capsys.readouterr().out
    assert re.search(r"^  max relative difference \S+: FAIL$", out, re.M), out
    assert out.rstrip().endswith("beyond the tolerance.")
    assert not torchgraft.is_enabled()


# ---- bench -----------------------------------------------------------------------------------


def _table_routes(stdout: str) -> set[str]:
    """Route names in the printed tables' first column."""
    known = {r.name for r in rms_norm_bench.routes()}
    return {
        line.split()[0]
        for line in stdout.splitlines()
        if line.split()[:1] and line.split()[0] in known
    }


def test_bench_quick_subprocess_writes_json_png_markdown(tmp_path):
    result = run_cli(
        "bench", "rms_norm", "--device", "cpu", "--quick", "--progress", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(r"\] +\d+/\d+ ", result.stderr)  # the progress bar, asked for with --progress
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rms_norm_cpu_fp32.json", "rms_norm_cpu_fp32.md", "rms_norm_cpu_fp32.png"]
    assert (tmp_path / "rms_norm_cpu_fp32.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((tmp_path / "rms_norm_cpu_fp32.json").read_text())

    printed = _table_routes(result.stdout)
    timed = {m["route"] for m in data["measurements"]}
    assert printed == timed
    assert {"eager", "aten"} <= timed
    # Every route that ran has every (shape, mode), within the dtype's tolerance.
    shapes = [
        "x".join(map(str, s)) for s in rms_norm_bench.default_shapes(torch.device("cpu"), True)
    ]
    assert data["shapes"] == shapes
    assert data["modes"] == ["fwd", "fwd+bwd"]
    for route in timed:
        got = {(m["shape"], m["mode"]) for m in data["measurements"] if m["route"] == route}
        assert got == {(s, mode) for s in shapes for mode in data["modes"]}, route
    for m in data["measurements"]:
        assert m["median_ms"] > 0
        assert m["rel_err"] <= rms_norm_bench.TOLERANCE[torch.float32]
        assert m["gbps"] == pytest.approx(m["bytes"] / (m["median_ms"] * 1e-3) / 1e9)
    assert {c["shape"] for c in data["copies"]} == set(shapes)
    # Routes left out are in the JSON with their reason, and printed.
    skipped = {r["name"]: r["skipped"] for r in data["routes"] if r["skipped"]}
    assert "compile" in skipped and "--quick" in skipped["compile"]
    for name, reason in skipped.items():
        assert f"{name}: {reason}" in result.stdout
    assert data["device"]["type"] == "cpu"
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["python"] == platform.python_version()
    md = (tmp_path / "rms_norm_cpu_fp32.md").read_text()
    for route in timed:
        assert f"| {route} " in md or f" {route} |" in md


@NATIVE
def test_bench_native_route_is_grafted_and_counted(tmp_path, capsys):
    code = cli.main(
        [
            "bench",
            "rms_norm",
            "--device",
            "cpu",
            "--shapes",
            "3x5x64,16x128",
            "--mode",
            "fwd+bwd",
            "--routes",
            "aten,torchgraft-native",
            "--out",
            str(tmp_path),
            "--no-plot",
            "--threads",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert not list(tmp_path.glob("*.png"))
    data = json.loads((tmp_path / "rms_norm_cpu_fp32.json").read_text())
    assert data["shapes"] == ["3x5x64", "16x128"]
    assert data["modes"] == ["fwd+bwd"]
    assert data["device"]["threads"] == 1
    assert {m["route"] for m in data["measurements"]} == {"aten", "torchgraft-native"}
    for m in data["measurements"]:
        if m["route"] == "aten":
            assert m["grafts"] is None and m["grafted"] is None
        else:
            # The checked run is one forward + backward: each CPU graft ran once.
            assert m["grafted"] is True
            assert {k: v["calls"] for k, v in m["grafts"].items()} == dict.fromkeys(
                graft_keys("CPU"), 1
            )
    not_selected = {r["name"] for r in data["routes"] if r["skipped"] == "not selected (--routes)"}
    assert not_selected == {r.name for r in rms_norm_bench.routes()} - {"aten", "torchgraft-native"}


def _broken_routes(original):
    def identity(_problem):
        return lambda x, weight: x * 1.0  # not RMSNorm

    def raises(_problem):
        def fn(x, weight):
            raise RuntimeError("kernel exploded\nsecond line")

        return fn

    def routes():
        stock = original()[0].dispatch
        always = lambda _device: None  # noqa: E731
        return (
            *original(),
            Route("wrong", "returns x", always, identity, stock),
            Route("boom", "raises", always, raises, stock),
        )

    return routes


def test_bench_reports_wrong_and_failing_routes_and_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rms_norm_bench, "routes", _broken_routes(rms_norm_bench.routes))
    code = cli.main(
        [
            "bench",
            "rms_norm",
            "--device",
            "cpu",
            "--shapes",
            "4x64",
            "--mode",
            "fwd",
            "--routes",
            "aten,wrong,boom",
            "--out",
            str(tmp_path),
            "--no-plot",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err
    data = json.loads((tmp_path / "rms_norm_cpu_fp32.json").read_text())
    assert {m["route"] for m in data["measurements"]} == {"aten"}
    reasons = {s["route"]: s["reason"] for s in data["skips"] if s["shape"] == "4x64"}
    assert reasons["wrong"].startswith("wrong result: relative error")
    assert reasons["boom"] == "RuntimeError: kernel exploded"
    assert re.search(r"^wrong\s+wrong$", captured.out, re.MULTILINE)
    assert re.search(r"^boom\s+error$", captured.out, re.MULTILINE)


def test_bench_terminal_table_wraps_shape_columns():
    config = harness.BenchConfig(
        op="rms_norm",
        device=torch.device("cpu"),
        dtype=torch.float32,
        shapes=[(2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (64, 64)],
        modes=["fwd"],
        routes=["aten"],
        quick=True,
    )
    report = harness.run(config)
    text = format_terminal(report, width=50)
    headers = [line for line in text.splitlines() if line.startswith(" ") and "x64" in line]
    assert len(headers) >= 2  # the six shape columns did not fit in one group
    table = text.split("copy: x.clone()")[0]
    assert all(len(line) <= 50 for line in table.splitlines() if not line.startswith("rms_norm"))
    for shape in report.shapes:
        assert shape in text


# ---- bench: requests that cannot run ----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["bench", "nosuchop", "--device", "cpu"], ["unknown op 'nosuchop'", "rms_norm"]),
        (["bench", "rms_norm", "--device", "tpu0"], ["unknown device 'tpu0'"]),
        (["bench", "rms_norm", "--device", "mps"], ["'mps' is not supported"]),
        (["bench", "rms_norm", "--device", "cpu", "--dtype", "int8"], ["unknown dtype 'int8'"]),
        (
            ["bench", "rms_norm", "--device", "cpu", "--shapes", "8x40a"],
            ["bad --shapes entry '8x40a'"],
        ),
        (
            ["bench", "rms_norm", "--device", "cpu", "--shapes", "0x64"],
            ["bad --shapes entry '0x64'"],
        ),
        (["bench", "rms_norm", "--device", "cpu", "--shapes", "64,"], ["bad --shapes entry ''"]),
        (
            ["bench", "rms_norm", "--device", "cpu", "--routes", "nope"],
            ["unknown route 'nope'", "aten"],
        ),
        (
            ["bench", "rms_norm", "--device", "cpu", "--threads", "0"],
            ["--threads must be at least 1"],
        ),
        (["bench", "rms_norm", "--mode", "sideways"], ["invalid choice: 'sideways'"]),
        (["bench"], ["required: op"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        ([], ["choose a command"]),
        (["demo", "--block", "--device", "cpu", "--routes", "nope"], ["unknown route 'nope'"]),
        (["demo", "--device", "cpu", "--routes", "native"], ["--routes is for --block only"]),
        (["demo", "--block", "--size", "tiny"], ["--size and --steps are for the model demo"]),
        (["demo", "--size", "huge"], ["invalid choice: 'huge'"]),
        (["demo", "--steps", "0"], ["--steps must be at least 1"]),
        (["demo", "--device", "cpu", "--dtype", "complex"], ["unknown dtype 'complex'"]),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, fragments, capsys):
    code = cli.main(args)
    captured = capsys.readouterr()
    assert_usage_error(code, captured.err, *fragments)
    assert captured.out == ""


@NO_CUDA
@pytest.mark.parametrize("command", ["bench rms_norm", "demo"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_absent_cuda_device_exits_2_subprocess(command, device):
    result = run_cli(*command.split(), "--device", device)
    assert_usage_error(result.returncode, result.stderr, f"device '{device}' is not present")
    assert result.stdout == ""


def test_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code = cli.main(
        ["bench", "rms_norm", "--device", "cpu", "--quick", "--out", str(blocker / "x")]
    )
    assert_usage_error(code, capsys.readouterr().err, "cannot write results to --out")


def test_cuda_graph_timing_needs_a_cuda_device(tmp_path, capsys):
    code = cli.main(
        ["bench", "swiglu", "--device", "cpu", "--quick", "--cuda-graph", "--out", str(tmp_path)]
    )
    assert_usage_error(code, capsys.readouterr().err, "--cuda-graph", "needs a CUDA device")
    assert list(tmp_path.iterdir()) == []


def test_cuda_graph_results_sit_beside_the_call_by_call_ones():
    from torchgraft.bench.results import file_stem

    report = harness.BenchReport(
        op="rope",
        device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
        dtype="bfloat16",
        modes=["fwd"],
        shapes=["2x8x4x2x64"],
        routes=[],
        versions={},
        timing="",
        quick=False,
        created="",
    )
    assert file_stem(report) == "rope_cuda-h100_bf16"
    report.cuda_graph = True
    assert file_stem(report) == "rope_cuda-h100_bf16_graph"


def test_unknown_op_subprocess():
    result = run_cli("bench", "layer_norm", "--device", "cpu")
    assert_usage_error(result.returncode, result.stderr, "unknown op 'layer_norm'")


def test_missing_third_party_kernel_exits_2(monkeypatch, capsys):
    real = bench_routes.module_available
    monkeypatch.setattr(
        rms_norm_bench, "module_available", lambda name: name != "liger_kernel" and real(name)
    )
    code = cli.main(["bench", "rms_norm", "--device", "cpu", "--routes", "liger"])
    assert_usage_error(
        code, capsys.readouterr().err, "route 'liger'", "Liger-Kernel is not installed"
    )


def _without_triton(monkeypatch):
    """A torchgraft with a "triton" route on a machine where triton is not installed."""
    monkeypatch.setattr(control, "ROUTES", ("native", "triton"))
    monkeypatch.setattr(bench_routes, "_dsl_module", lambda name: None)
    real = bench_routes.module_available
    monkeypatch.setattr(
        bench_routes, "module_available", lambda name: name != "triton" and real(name)
    )


def test_missing_dsl_for_a_route_exits_2(monkeypatch, capsys):
    _without_triton(monkeypatch)
    code = cli.main(["bench", "rms_norm", "--device", "cpu", "--routes", "torchgraft-triton"])
    assert_usage_error(
        code, capsys.readouterr().err, "route 'torchgraft-triton'", "triton is not installed"
    )
    code = cli.main(["demo", "--block", "--device", "cpu", "--routes", "triton"])
    assert_usage_error(code, capsys.readouterr().err, "route 'triton'", "triton is not installed")


def test_missing_dsl_route_is_skipped_with_reason_by_default(monkeypatch, tmp_path, capsys):
    _without_triton(monkeypatch)
    code = cli.main(
        [
            "bench",
            "rms_norm",
            "--device",
            "cpu",
            "--shapes",
            "4x64",
            "--mode",
            "fwd",
            "--out",
            str(tmp_path),
            "--no-plot",
            "--quick",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "rms_norm_cpu_fp32.json").read_text())
    skipped = {r["name"]: r["skipped"] for r in data["routes"]}
    assert "triton is not installed" in skipped["torchgraft-triton"]
    assert "torchgraft-triton: triton is not installed" in out


# ---- doctor ----------------------------------------------------------------------------------


def test_doctor_subprocess_reports_versions_and_native_library():
    result = run_cli("doctor", env={control.DISABLE_NATIVE_ENV: "1"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert platform.python_version() in out
    assert torch.__version__ in out
    assert re.search(r"^CUDA available\s+(yes|no)$", out, re.MULTILINE)
    assert re.search(rf"^  built\s+{'yes' if native.available() else 'no'}$", out, re.MULTILINE)
    for g in native.grafts():
        assert f"{g.op} @ {g.dispatch_key}" in out
    for dsl in ("triton", "cutedsl", "helion", "cutile"):
        assert re.search(rf"^  {dsl}\s+\S", out, re.MULTILINE)
    # The kill switch is shown as set, and what it disables.
    assert re.search(rf"^  {control.DISABLE_NATIVE_ENV}\s+1$", out, re.MULTILINE)
    assert f"route native: {control.DISABLE_NATIVE_ENV} is set" in out


def test_doctor_imports_no_dsl():
    code = (
        "import sys; from torchgraft.cli import main; rc = main(['doctor', '--json']);"
        "dsls = ('triton', 'cutlass', 'helion', 'cuda.tile', 'liger_kernel');"
        "print(sorted(m for m in dsls if m in sys.modules), rc, file=sys.stderr)"
    )
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.stderr.strip().splitlines()[-1] == "[] 0", result.stderr
    json.loads(result.stdout)


def test_doctor_json_facts(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["python"]["version"] == platform.python_version()
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["cuda"]["built_with"] == torch.version.cuda
    assert facts["torch"]["cuda"]["available"] == torch.cuda.is_available()
    assert len(facts["torch"]["cuda"]["devices"]) == (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    assert facts["native"]["built"] == native.available()
    assert facts["native"]["grafts"] == [f"{g.op} @ {g.dispatch_key}" for g in native.grafts()]
    assert set(facts["torchgraft"]["routes"]) == set(control.ROUTES)
    assert set(facts["dsl"]) >= {"triton", "cutedsl", "helion", "cutile"}


@NATIVE
def test_doctor_shows_native_build_info(monkeypatch, capsys):
    from torchgraft import _native

    info = {
        "version": "9.9.9",
        "cuda_kernels_built": False,
        "cuda_devices": "cuInit failed: no driver",
        "torch_abi": "2.11+",
    }
    monkeypatch.setattr(_native, "build_info", lambda: info, raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key, value in info.items():
        assert re.search(rf"^  {key}\s+{re.escape(str(value))}$", out, re.MULTILINE), key
    assert "native CUDA kernels: not built into this library" in out
    assert "native CUDA kernels: cuInit failed: no driver" in out


@NATIVE
def test_doctor_prints_the_native_version_once(capsys):
    assert cli.main(["doctor"]) == 0
    section = capsys.readouterr().out.split("native library")[1].split("\n\n")[0]
    assert len(re.findall(r"^  version\s", section, re.MULTILINE)) == 1, section


def test_doctor_lists_what_the_switches_turned_off(monkeypatch, capsys):
    monkeypatch.setattr(torchgraft.control, "_disabled_ops", frozenset({"_softmax"}))
    monkeypatch.setattr(torchgraft.control, "is_dsl_enabled", lambda dsl: dsl != "helion")
    assert cli.main(["doctor", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert "op _softmax: switched off (torchgraft.backends)" in facts["disabled"]
    assert "DSL helion: switched off (torchgraft.backends)" in facts["disabled"]
    assert facts["torchgraft"]["switches"] == {
        "operations_disabled": ["_softmax"],
        "dsls_disabled": ["helion"],
    }


def _fake_dsl_package(monkeypatch):
    """Stand-in for torchgraft.dsl (the registry branch): helion installed but too old."""

    def helper(name, installed, version, reason):
        mod = types.SimpleNamespace(
            NAME=name,
            PACKAGE=f"{name}-pkg",
            runtime_available=lambda: installed,
            runtime_version=lambda: version,
            runtime=types.SimpleNamespace(unusable_reason=lambda: reason),
        )
        return mod

    dsl = types.ModuleType("torchgraft.dsl")
    dsl.__spec__ = importlib.machinery.ModuleSpec("torchgraft.dsl", None)
    dsl.DSLS = {
        "triton": helper("triton", True, "3.6.0", None),
        "helion": helper("helion", True, "0.9", "helion 0.9 is older than the required 1.0"),
        "cutile": helper("cutile", False, None, "cutile is not installed"),
        "native": helper("native", True, "0.1.0", None),
    }
    monkeypatch.setitem(sys.modules, "torchgraft.dsl", dsl)
    monkeypatch.setattr(torchgraft, "dsl", dsl, raising=False)


def test_doctor_uses_registry_dsl_helpers(monkeypatch, capsys):
    _fake_dsl_package(monkeypatch)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  triton\s+3\.6\.0$", out, re.MULTILINE)
    assert re.search(
        r"^  helion\s+0\.9 \(not used: helion 0\.9 is older than the required 1\.0\)$",
        out,
        re.MULTILINE,
    )
    assert re.search(r"^  cutile\s+not installed \(cutile-pkg\)$", out, re.MULTILINE)
    assert not re.search(
        r"^  native\s", out.split("DSL runtimes")[1].split("other packages")[0], re.MULTILINE
    )


# ---- list ------------------------------------------------------------------------------------


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    assert lines[0].split() == ["OP", "KEY", "ROUTE", "STATE", "CALLS", "FALLBACKS", "TAKES"]
    return [
        line.split()[:6]  # the TAKES column is free text
        for line in lines[1:]
        if line.strip() and not line.startswith(("(", "torchgraft is"))
    ]


@NATIVE
def test_list_subprocess_native_grafts_inactive():
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    native_rows = [r for r in rows if r[2] == "native"]
    assert sorted((r[0], r[1]) for r in native_rows) == sorted(
        (g.op, g.dispatch_key) for g in native.grafts() + native.op_kernels()
    )
    # Nothing grafted, and torchgraft's own operators not defined (functional not imported).
    assert all(r[3] == "inactive" and r[4] == "0" for r in native_rows)
    assert "torchgraft is not enabled" in result.stdout


@NATIVE
def test_list_enable_shows_active_grafts_and_calls(capsys):
    torchgraft.enable(routes=["native"])
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    torch.nn.functional.rms_norm(x, (32,), w).sum().backward()
    assert cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["enabled"] is True
    by_op = {
        (r["op"], r["dispatch_key"]): r
        for r in data["grafts"]
        if r["route"] == "native" and r["op"].startswith("aten::")
    }
    assert by_op[("aten::_fused_rms_norm", "CPU")]["calls"] == 1
    assert by_op[("aten::_fused_rms_norm_backward", "CPU")]["calls"] == 1
    assert all(r["state"] == "active" for (_, key), r in by_op.items() if key == "CPU")


@NATIVE
def test_list_enable_flag(capsys):
    assert cli.main(["list", "--enable"]) == 0
    rows = _rows(capsys.readouterr().out)
    grafts = [r for r in rows if r[2] == "native" and r[0].startswith("aten::")]
    assert grafts and all(r[3] == "active" for r in grafts if r[1] == "CPU")


@NATIVE
def test_list_shows_every_native_counter_stats_reports(capsys):
    import torchgraft.functional  # defines torchgraft's own operators

    assert cli.main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["grafts"]
    listed = {f"native/{r['op']}/{r['dispatch_key']}" for r in rows if r["route"] == "native"}
    reported = {key for key in torchgraft.stats() if key.startswith("native/")}
    assert any(key.startswith("native/torchgraft::") for key in reported)
    assert listed == reported
    swiglu = next(r for r in rows if r["op"] == "torchgraft::swiglu" and r["dispatch_key"] == "CPU")
    assert swiglu["state"] == "active" and swiglu["source"] == "torchgraft._native"


@NATIVE
def test_list_marks_grafts_switched_off(capsys):
    try:
        torchgraft.backends.disable_operations("_softmax")
        assert cli.main(["list", "--enable"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert ["aten::_softmax", "CPU", "native", "switched-off", "0", "0"] in rows
        assert ["aten::_log_softmax", "CPU", "native", "active", "0", "0"] in rows
    finally:
        torchgraft.backends.enable_operations("_softmax")
        torchgraft.disable()


@dataclass(frozen=True)
class FakeOverride:
    dsl: str
    op: str
    dispatch_key: str
    active: bool
    installed: bool
    unconditional: bool
    calls: int
    fallbacks: int


def test_list_includes_registry_overrides(monkeypatch, capsys):
    overrides = [
        FakeOverride("triton", "aten::_fused_rms_norm", "CUDA", True, True, False, 7, 2),
        FakeOverride("helion", "aten::_fused_rms_norm", "CUDA", False, False, True, 0, 0),
    ]
    registry = types.ModuleType("torchgraft.registry")
    registry.__spec__ = importlib.machinery.ModuleSpec("torchgraft.registry", None)
    registry.list_overrides = lambda: overrides
    registry.override_stats = lambda: {
        f"{o.dsl}/{o.op}/{o.dispatch_key}": {"calls": o.calls, "fallbacks": o.fallbacks}
        for o in overrides
    }
    monkeypatch.setitem(sys.modules, "torchgraft.registry", registry)
    monkeypatch.setattr(torchgraft, "registry", registry, raising=False)
    assert cli.main(["list"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert ["aten::_fused_rms_norm", "CUDA", "triton", "active", "7", "2"] in rows
    assert ["aten::_fused_rms_norm", "CUDA", "helion", "filtered", "0", "0"] in rows
    # The registry's counters also reach the graft counters the demo and bench read.
    from torchgraft.bench.counters import graft_counters

    assert graft_counters()["triton/aten::_fused_rms_norm/CUDA"] == {"calls": 7, "fallbacks": 2}


def test_list_subprocess_runs_on_this_torch():
    # `torchgraft list` crashed on torch 2.15 (it unpacked torch._native's private graph keys).
    result = run_cli("list", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["grafts"]
    expected = {(o.op, o.dispatch_key, f"torch._native/{o.dsl}") for o in torch_native.overrides()}
    listed = {
        (r["op"], r["dispatch_key"], r["route"]) for r in rows if r["source"] == "torch._native"
    }
    assert listed == expected


def test_list_shows_an_override_of_a_missing_op_as_unavailable(capsys):
    from torchgraft import registry

    try:
        with pytest.warns(UserWarning, match="does not exist"):
            registry.register_op_override(
                "future",
                "aten",
                "no_such_op_xyz",
                "CPU",
                None,
                lambda *a: None,
                unconditional_override=True,
            )
        assert cli.main(["list"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert ["aten::no_such_op_xyz", "CPU", "future", "unavailable", "0", "0"] in rows
    finally:
        registry.clear_overrides()


# ---- small pieces ----------------------------------------------------------------------------


def test_version_and_help(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("torchgraft ")
    assert cli.main(["bench", "--help"]) == 0
    assert "--shapes" in capsys.readouterr().out
    assert cli.main(["demo", "--help"]) == 0
    assert "--block" in capsys.readouterr().out


def test_parse_shapes_and_dtype():
    assert cli.parse_shapes("8x4096x4096, 4096x1024") == [(8, 4096, 4096), (4096, 1024)]
    assert cli.parse_dtype("bf16") is torch.bfloat16
    assert cli.parse_dtype("torch.float16") is torch.float16
    assert cli.parse_dtype(None) is None


def test_progress_bar_draws_only_when_enabled():
    import io

    shown, hidden = io.StringIO(), io.StringIO()
    for stream, enabled in ((shown, True), (hidden, False)):
        bar = Progress(4, enabled=enabled, stream=stream)
        bar.advance("a")
        bar.advance("b", steps=2)
        bar.close()
    assert hidden.getvalue() == ""
    assert "] 1/4" in shown.getvalue() and "] 3/4" in shown.getvalue()
    assert "#" * 22 in shown.getvalue()  # 3/4 of 30 cells


def test_tables_mark_a_graft_that_did_not_run():
    from torchgraft.bench.harness import BenchReport, Measurement
    from torchgraft.bench.table import format_markdown

    report = BenchReport(
        op="rms_norm",
        device={"type": "cuda", "name": "Some GPU"},
        dtype="bfloat16",
        modes=["fwd"],
        shapes=["4x8"],
        routes=[{"name": n, "summary": "", "skipped": None} for n in ("aten", "torchgraft-x")],
        versions={},
        timing="",
        quick=False,
        created="",
    )
    declined = {"x/aten::_fused_rms_norm/CUDA": {"calls": 0, "fallbacks": 1}}
    report.measurements = [
        Measurement("aten", "fwd", "4x8", 100, 0.5, 0.2, None, 0.0, None),
        Measurement("torchgraft-x", "fwd", "4x8", 100, 0.25, 0.4, None, 0.0, declined),
    ]
    terminal = format_terminal(report)
    assert re.search(r"^torchgraft-x\s+0\.250 2\.00x\*$", terminal, re.MULTILINE)
    assert "* the route's graft did not run" in terminal
    markdown = format_markdown(report)
    assert "| 4x8 | 0.500 (1.00x) | 0.250 (2.00x)\\* | - |" in markdown
    assert "- \\* the route's graft did not run" in markdown


def test_native_route_needs_a_graft_for_the_device():
    has_cuda_graft = any(g.dispatch_key == "CUDA" for g in native.grafts())
    reason = bench_routes.torchgraft_route_unavailable("native", torch.device("cuda"))
    if not native.available():
        assert reason == "the extension torchgraft._native is not built"
    elif has_cuda_graft:
        assert reason is None
    else:
        assert reason == "this build of torchgraft._native has no graft for CUDA"
