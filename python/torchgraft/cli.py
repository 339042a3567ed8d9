"""The ``torchgraft`` command (also ``python -m torchgraft``): demo, bench, doctor, list.

Every subcommand returns an exit status: 0 success, 1 a check failed (demo FAIL, a benchmark
route gave a wrong result or an error), 2 a request that cannot run (unknown op, route or
dtype, a device that is not present, a missing DSL, bad arguments), reported as one line on
stderr without a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

__all__ = ["CliError", "main"]

PROG = "torchgraft"


class CliError(Exception):
    """A request that cannot run as given; main() prints the message and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line and exit status 2 like every other usage error (argparse prints the usage).
        raise CliError(f"{message} (see '{self.prog} --help')")


# ---- argument values -------------------------------------------------------------------------

_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "float64": "float64",
}


def parse_dtype(text: str | None) -> torch.dtype | None:
    """``bf16``, ``fp16``, ``fp32``, ``fp64`` (or torch's names); None stays None (default)."""
    if text is None:
        return None
    import torch

    name = _DTYPE_NAMES.get(text.strip().lower().removeprefix("torch."))
    if name is None:
        raise CliError(f"unknown dtype {text!r}; use one of bf16, fp16, fp32, fp64")
    return getattr(torch, name)


def parse_device(text: str | None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked to be present; ``auto``/None: a GPU if any."""
    import torch

    if text is None or text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise CliError(f"device {text!r} is not supported here; use cpu, cuda or cuda:N")
    if torch.version.cuda is None:
        raise CliError(f"device {text!r} is not present: torch {torch.__version__} has no CUDA")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise CliError(
            f"device {text!r} is not present: no CUDA GPU is visible "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda})"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= count:
        raise CliError(f"device {text!r} is not present: {count} CUDA GPU(s) visible")
    return torch.device("cuda", index)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``8x4096x4096,4096x1024`` -> ``[(8, 4096, 4096), (4096, 1024)]`` (last dim normalized)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            shape = ()
        if not shape or len(shape) > 8 or any(s <= 0 for s in shape):
            raise CliError(
                f"bad --shapes entry {item.strip()!r}: expected positive sizes joined by 'x', "
                "shapes separated by commas, e.g. 8x4096x4096,4096x1024"
            )
        shapes.append(shape)
    return shapes


def _parse_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CliError(f"empty list {text!r}")
    return items


# ---- bench -----------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from torchgraft.bench import harness, results, table

    op = harness.OPS.get(args.op)
    if args.op == "model":
        raise CliError("put the options after 'model': torchgraft bench model [options]")
    if op is None:
        raise CliError(f"unknown op {args.op!r}; known: {', '.join(harness.OPS)}")
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype) or op.default_dtype(device)
    if dtype not in op.TOLERANCE:
        raise CliError(f"{args.op} has no {dtype} benchmark")
    shapes = parse_shapes(args.shapes) if args.shapes else op.default_shapes(device, args.quick)
    for shape in shapes:
        why = op.check_shape(shape)
        if why is not None:
            raise CliError(f"bad --shapes entry {'x'.join(map(str, shape))!r} for {args.op}: {why}")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    modes = list(op.MODES) if args.mode == "both" else [args.mode]
    config = harness.BenchConfig(
        op=args.op,
        device=device,
        dtype=dtype,
        shapes=shapes,
        modes=modes,
        routes=_parse_list(args.routes),
        quick=args.quick,
        cuda_graph=args.cuda_graph,
    )
    out_dir = Path(args.out)
    try:  # before the sweep, so a bad --out costs nothing
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(f"cannot write results to --out {args.out!r}: {error.strerror}") from None
    show_progress = args.progress or sys.stderr.isatty()
    try:
        report = harness.run(config, progress=show_progress, command=harness.command_line(argv))
    except harness.BenchError as error:
        raise CliError(str(error)) from None
    width = shutil.get_terminal_size((120, 24)).columns
    print(table.format_terminal(report, width=width), end="")
    written = results.write_results(report, out_dir, plot=not args.no_plot)
    print()
    print(f"wrote {written.json}")
    print(f"wrote {written.markdown}")
    if written.plot is not None:
        print(f"wrote {written.plot}")
    elif not args.no_plot:
        print(f"{PROG}: no plot: {written.plot_skipped}", file=sys.stderr)
    failed = [s for s in report.skips if s.shape is not None]
    if failed:
        print(
            f"{PROG}: {len(failed)} route run(s) gave a wrong result or an error (listed above)",
            file=sys.stderr,
        )
        return 1
    return 0


# ---- doctor ----------------------------------------------------------------------------------

KILL_SWITCHES = (
    "TORCHGRAFT_DISABLE",
    "TORCHGRAFT_DISABLE_NATIVE",
    "TORCH_DISABLE_NATIVE_JIT",
    "TORCHGRAFT_SKIP_VERSION_CHECK",
)
"""Environment variables that switch grafts off (or gates off), shown by doctor when set."""

# DSL name -> (distribution, module), used when torchgraft.dsl (the registry) is not present.
_DSL_FALLBACK = {
    "triton": ("triton", "triton"),
    "cutedsl": ("nvidia-cutlass-dsl", "cutlass"),
    "helion": ("helion", "helion"),
    "cutile": ("cuda-tile", "cuda.tile"),
}
_OPTIONAL_PACKAGES = (
    "numpy",
    "matplotlib",
    "liger-kernel",
    "nvidia-cutlass-dsl",
    "flash-attn-4",
    "quack-kernels",
    "apache-tvm-ffi",
)


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _top_level_found(module: str) -> bool:
    # Only the top-level name: find_spec("a.b") would import package "a".
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _dsl_facts() -> dict[str, dict[str, Any]]:
    """Each DSL runtime: installed, version, and why torchgraft would not use it (no import)."""
    from torchgraft.bench.routes import dsl_unusable_reason

    facts: dict[str, dict[str, Any]] = {}
    modules: dict[str, Any] = {}
    if importlib.util.find_spec("torchgraft.dsl") is not None:
        import torchgraft.dsl as dsl

        modules = {k: v for k, v in getattr(dsl, "DSLS", {}).items() if k != "native"}
    if modules:
        for name, module in modules.items():
            version = module.runtime_version()
            facts[name] = {
                "installed": bool(module.runtime_available()),
                "version": str(version) if version is not None else None,
                "package": getattr(module, "PACKAGE", None),
                "unusable": dsl_unusable_reason(name),
            }
            facts[name].update(_dsl_extras(module))
        return facts
    for name, (package, module_name) in _DSL_FALLBACK.items():
        version = _version_of(package)
        installed = _top_level_found(module_name) and (
            version is not None or "." not in module_name
        )
        facts[name] = {
            "installed": installed,
            "version": version if installed else None,
            "package": package,
            "unusable": None if installed else f"{name} is not installed ({package})",
        }
    return facts


def _dsl_extras(module: Any) -> dict[str, Any]:
    """Kernel libraries written in the DSL (CuteDSL: FA4, quack) and its compiler (cuTile:
    tileiras), found without importing them."""
    extras: dict[str, Any] = {}
    libraries = getattr(module, "LIBRARIES", None)
    if libraries:
        extras["libraries"] = {}
        for library in libraries:
            version = module.library_version(library)
            extras["libraries"][library] = {
                "version": str(version) if version is not None else None,
                "unusable": module.library_unusable_reason(library),
            }
    tileiras_version = getattr(module, "tileiras_version", None)
    if tileiras_version is not None and module.runtime_available():
        version = tileiras_version()
        extras["tileiras"] = str(version) if version is not None else None
    return extras


def _cuda_facts() -> dict[str, Any]:
    import torch

    available = torch.cuda.is_available()
    devices = []
    for index in range(torch.cuda.device_count() if available else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return {
        "built_with": torch.version.cuda,
        "available": available,
        "devices": devices,
        "driver_error": None if available or torch.version.cuda is None else _cuda_init_error(),
    }


def _cuda_init_error() -> str | None:
    import warnings

    import torch

    # torch.cuda.is_available() swallows why; device_count's warning carries it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.device_count()
    for warning in caught:
        return str(warning.message).splitlines()[0]
    return "no CUDA GPU visible"


def _native_facts() -> dict[str, Any]:
    from torchgraft import native

    facts: dict[str, Any] = {
        "built": native.available(),
        "loaded": False,
        "error": None,
        "version": None,
        "build_info": None,
        "enabled": False,
        "grafts": [],
    }
    if not facts["built"]:
        facts["error"] = "torchgraft._native is not built (make build, or install a wheel)"
        return facts
    try:
        import torch  # noqa: F401  (libtorch must be loaded before the extension)

        from torchgraft import _native
    except Exception as error:  # an import failure is a finding, not a crash
        facts["error"] = f"{type(error).__name__}: {error}"
        return facts
    facts["loaded"] = True
    facts["version"] = getattr(_native, "__version__", None)
    build_info = getattr(_native, "build_info", None)
    if build_info is not None:
        try:
            facts["build_info"] = dict(build_info())
        except Exception as error:
            facts["build_info"] = {"error": f"{type(error).__name__}: {error}"}
    facts["enabled"] = native.is_enabled()
    facts["grafts"] = [f"{g.op} @ {g.dispatch_key}" for g in native.grafts()]
    return facts


def _torch_native_facts() -> dict[str, Any]:
    import torch

    from torchgraft.bench.routes import torch_native_active

    present = importlib.util.find_spec("torch._native") is not None
    return {
        "present": present,
        "rms_norm_override_active": present and torch_native_active("_fused_rms_norm", "CUDA"),
        "note": None if present else f"torch {torch.__version__} has no torch._native",
    }


def _switch_facts() -> dict[str, list[str]]:
    """What torchgraft.backends has switched off in this process."""
    from torchgraft import control, dsl

    return {
        "operations_disabled": control.disabled_operations(),
        "dsls_disabled": [name for name in dsl.DSLS if not control.is_dsl_enabled(name)],
    }


def doctor_facts() -> dict[str, Any]:
    """Everything ``torchgraft doctor`` reports, as a JSON-ready dict. Imports no DSL."""
    import torch

    import torchgraft
    from torchgraft import control
    from torchgraft.bench.harness import torchgraft_version
    from torchgraft.bench.routes import torchgraft_route_unavailable

    cuda = _cuda_facts()
    native_facts = _native_facts()
    dsl = _dsl_facts()
    routes: dict[str, str | None] = {}
    for route in control.ROUTES:
        reason = torchgraft_route_unavailable(route, None)
        if reason is None and route != "native" and not cuda["available"]:
            reason = f"no CUDA GPU visible (the {route} route runs on CUDA GPUs)"
        routes[route] = reason
    env = {name: os.environ[name] for name in KILL_SWITCHES if name in os.environ}
    env.update(
        {k: v for k, v in os.environ.items() if k.startswith("TORCHGRAFT_") and k not in env}
    )
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]

    disabled = [f"route {name}: {reason}" for name, reason in routes.items() if reason]
    info = native_facts.get("build_info") or {}
    if native_facts["loaded"] and info.get("cuda_kernels_built") is False:
        disabled.append("native CUDA kernels: not built into this library (no nvcc at build time)")
    if isinstance(info.get("cuda_devices"), str):
        disabled.append(f"native CUDA kernels: {info['cuda_devices']}")
    switches = _switch_facts()
    disabled += [
        f"op {op}: switched off (torchgraft.backends)" for op in switches["operations_disabled"]
    ]
    disabled += [
        f"DSL {name}: switched off (torchgraft.backends)" for name in switches["dsls_disabled"]
    ]
    for override in _registry_rows():
        if override["state"] != "active":
            disabled.append(
                f"override {override['route']} {override['op']} @ {override['dispatch_key']}: "
                f"{override['state']}"
            )
    return {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "torch": {
            "version": torch.__version__,
            "path": os.path.dirname(torch.__file__),
            "cuda": cuda,
            "torch_native": _torch_native_facts(),
        },
        "torchgraft": {
            "version": torchgraft_version(),
            "path": os.path.dirname(torchgraft.__file__),
            "enabled": torchgraft.is_enabled(),
            "routes": routes,
            "switches": switches,
        },
        "native": native_facts,
        "dsl": dsl,
        "packages": {name: _version_of(name) for name in _OPTIONAL_PACKAGES},
        "env": env,
        "disabled": disabled,
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _print_doctor(facts: dict[str, Any]) -> None:
    def row(key: str, value: object, indent: int = 2) -> None:
        print(f"{' ' * indent}{key:<24} {value}")

    py, tch, tg, nat = facts["python"], facts["torch"], facts["torchgraft"], facts["native"]
    cuda = tch["cuda"]
    print("torchgraft doctor")
    print()
    row("python", f"{py['version']} ({py['implementation']}) {py['executable']}", 0)
    row("platform", py["platform"], 0)
    row("torch", f"{tch['version']} at {tch['path']}", 0)
    row("CUDA (torch built with)", cuda["built_with"] or "none (CPU-only torch)", 0)
    row("CUDA available", _yes(cuda["available"]), 0)
    for gpu in cuda["devices"]:
        row(
            f"GPU {gpu['index']}",
            f"{gpu['name']}, compute capability {gpu['capability']}, {gpu['memory_gib']} GiB",
            0,
        )
    if not cuda["devices"]:
        why = f" ({cuda['driver_error']})" if cuda["driver_error"] else ""
        row("GPUs", f"none visible{why}", 0)
    tn = tch["torch_native"]
    row(
        "torch._native",
        f"present, RMSNorm override active: {_yes(tn['rms_norm_override_active'])}"
        if tn["present"]
        else tn["note"],
        0,
    )
    row("torchgraft", f"{tg['version'] or 'unknown version'} at {tg['path']}", 0)
    row("enabled", _yes(tg["enabled"]), 0)
    print()
    print("native library (torchgraft._native)")
    row("built", _yes(nat["built"]))
    row("loaded", _yes(nat["loaded"]) + (f" ({nat['error']})" if nat["error"] else ""))
    if nat["version"]:
        row("version", nat["version"])
    if nat["build_info"]:
        for key, value in nat["build_info"].items():
            if key == "version" and value == nat["version"]:
                continue  # the row above
            row(str(key), value)
    elif nat["loaded"]:
        row("build info", "not reported by this build")
    row("grafts", ", ".join(nat["grafts"]) or "none")
    print()
    print("routes")
    for name, reason in tg["routes"].items():
        row(name, "available" if reason is None else f"unavailable: {reason}")
    print()
    print("DSL runtimes (found without importing them)")
    for name, dsl in facts["dsl"].items():
        if dsl["installed"]:
            text = f"{dsl['version'] or 'unknown version'}"
            if dsl["unusable"]:
                text += f" (not used: {dsl['unusable']})"
        else:
            text = f"not installed ({dsl['package']})"
        row(name, text)
        if "tileiras" in dsl:
            row("tileiras", dsl["tileiras"] or "not found (needed to compile)", 4)
        for library, lib in dsl.get("libraries", {}).items():
            lib_text = lib["version"] or "not installed"
            if lib["version"] and lib["unusable"]:
                lib_text += f" (not used: {lib['unusable']})"
            row(library, lib_text, 4)
    print()
    print("other packages")
    for name, version in facts["packages"].items():
        row(name, version or "not installed")
    print()
    print("environment")
    if facts["env"]:
        for name, value in facts["env"].items():
            row(name, value)
    else:
        row("(none of these set)", ", ".join(KILL_SWITCHES))
    print()
    print("disabled")
    if facts["disabled"]:
        for line in facts["disabled"]:
            print(f"  - {line}")
    else:
        print("  nothing")


def _cmd_doctor(args: argparse.Namespace) -> int:
    facts = doctor_facts()
    if args.json:
        print(json.dumps(facts, indent=1))
    else:
        _print_doctor(facts)
    return 0


# ---- list ------------------------------------------------------------------------------------


def _registry_rows() -> list[dict[str, Any]]:
    from torchgraft.bench.counters import registry_module

    registry = registry_module()
    list_overrides = getattr(registry, "list_overrides", None)
    if list_overrides is None:
        return []
    from torchgraft.control import gate_notes

    notes = gate_notes()
    rows = []
    for o in list_overrides():
        installed = getattr(o, "installed", True)
        if not getattr(o, "op_available", True):
            state = "unavailable"
        elif o.active:
            state = "active" if installed else "suspended"
        else:
            state = "filtered"
        rows.append(
            {
                "op": o.op,
                "dispatch_key": o.dispatch_key,
                "route": o.dsl,
                "state": state,
                "calls": o.calls,
                "fallbacks": getattr(o, "fallbacks", None),
                "source": "torchgraft.registry",
                "why": notes.get((o.dsl, o.op.partition("::")[2])),
            }
        )
    return rows


def list_rows() -> list[dict[str, Any]]:
    """Every native graft, registry override, and torch._native override in this process."""
    import torch  # noqa: F401  (libtorch first: the native extension looks it up)

    from torchgraft import control, native
    from torchgraft.registry import torch_native

    def state(g: native.NativeGraft) -> str:
        if g.active:
            return "active"
        switched_off = control.is_operation_disabled(g.op.partition("::")[2])
        return (
            "switched-off" if switched_off or not control.is_dsl_enabled("native") else "inactive"
        )

    # The grafts under aten ops, then the kernels of torchgraft's own operators (active once
    # torchgraft.functional defined them); torchgraft.stats() counts both.
    rows = [
        {
            "op": g.op,
            "dispatch_key": g.dispatch_key,
            "route": "native",
            "state": state(g),
            "calls": g.calls,
            "fallbacks": g.fallbacks,
            "source": "torchgraft._native",
        }
        for g in native.grafts() + native.op_kernels()
    ]
    rows += _registry_rows()
    rows += [
        {
            "op": o.op,
            "dispatch_key": o.dispatch_key,
            "route": f"torch._native/{o.dsl}",
            "state": "active" if o.active else "filtered",
            "calls": None,
            "fallbacks": None,
            "source": "torch._native",
        }
        for o in torch_native.overrides()
    ]
    return rows


def _cmd_list(args: argparse.Namespace) -> int:
    import torchgraft

    if args.enable:
        torchgraft.enable()
    rows = list_rows()
    if args.json:
        print(json.dumps({"enabled": torchgraft.is_enabled(), "grafts": rows}, indent=1))
        return 0
    columns = ("op", "dispatch_key", "route", "state", "calls", "fallbacks", "why")
    headers = ("OP", "KEY", "ROUTE", "STATE", "CALLS", "FALLBACKS", "TAKES")
    cells = [[("-" if r.get(c) is None else str(r[c])) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    if not rows:
        print("(no grafts: the native library is not built and no override is registered)")
    print()
    print(
        f"torchgraft is {'enabled' if torchgraft.is_enabled() else 'not enabled'} in this process"
        + ("" if args.enable else " (add --enable to list what torchgraft.enable() installs)")
    )
    return 0


# ---- parser and entry point ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``torchgraft`` argument parser."""
    parser = _Parser(
        prog=PROG,
        description="Graft fast kernels under PyTorch's own operators: try, measure, inspect.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    # Its options are torchgraft.demo's own (see 'torchgraft demo --help').
    sub.add_parser(
        "demo", help="a transformers Llama, stock vs torchgraft: adoption, accuracy, speed, ops"
    )

    bench = sub.add_parser("bench", help="every route of an op side by side: table, JSON, plot")
    bench.add_argument(
        "op",
        help="op to benchmark (rms_norm, swiglu, geglu, rope, cross_entropy, "
        "linear_cross_entropy), or model (see 'torchgraft bench model --help')",
    )
    bench.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    bench.add_argument(
        "--dtype", help="bf16, fp16, fp32 or fp64 (default: bf16 on CUDA, fp32 on CPU)"
    )
    bench.add_argument(
        "--shapes",
        help="e.g. 8x4096x4096,4096x1024 (rms_norm: the last dim is normalized; the other ops' "
        "shapes: docs/cli.md)",
    )
    bench.add_argument("--quick", action="store_true", help="a tiny sweep with short timings")
    bench.add_argument(
        "--mode", choices=("fwd", "fwd+bwd", "both"), default="both", help="default: both"
    )
    bench.add_argument("--routes", help="comma-separated routes (default: all that can run)")
    bench.add_argument(
        "--out", default=os.path.join("bench", "results"), help="directory (default bench/results)"
    )
    bench.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    bench.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time replays of a CUDA graph of each call: GPU time without host launch overhead",
    )
    bench.add_argument("--no-plot", action="store_true", help="write no PNG")
    bench.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")

    doctor = sub.add_parser("doctor", help="versions, GPUs, DSL runtimes, native library, switches")
    doctor.add_argument("--json", action="store_true", help="print JSON")

    listing = sub.add_parser("list", help="every native graft and registered override")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("--enable", action="store_true", help="call torchgraft.enable() first")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if args_list[:2] == ["bench", "model"]:  # its own options: torchgraft/bench/model_command
            from torchgraft.bench import model_command

            return model_command.main(args_list[2:])
        if args_list[:1] == ["demo"]:  # its own options: torchgraft/demo
            from torchgraft import demo

            return demo.main(args_list[1:])
        args = parser.parse_args(args_list)
        if args.version:
            from torchgraft.bench.harness import torchgraft_version

            print(f"{PROG} {torchgraft_version() or 'unknown version'}")
            return 0
        if args.command is None:
            raise CliError(f"choose a command: demo, bench, doctor or list (see '{PROG} --help')")
        if args.command == "bench":
            return _cmd_bench(args, args_list)
        if args.command == "doctor":
            return _cmd_doctor(args)
        return _cmd_list(args)
    except CliError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``torchgraft ... | head``): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
