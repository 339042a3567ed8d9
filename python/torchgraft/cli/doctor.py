"""``torchgraft doctor``: versions, GPUs, DSL runtimes, the native library, switches."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any

from .listing import registry_rows

__all__ = ["KILL_SWITCHES", "cmd_doctor", "doctor_facts"]

KILL_SWITCHES = (
    "TORCHGRAFT_DISABLE",
    "TORCHGRAFT_DISABLE_NATIVE",
    "TORCH_DISABLE_NATIVE_JIT",
    "TORCHGRAFT_SKIP_VERSION_CHECK",
)
"""Environment variables that switch grafts off (or gates off), shown by doctor when set."""

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


def _dsl_facts() -> dict[str, dict[str, Any]]:
    """Each DSL runtime: installed, version, and why torchgraft would not use it (no import)."""
    from torchgraft import dsl
    from torchgraft.bench.routes import dsl_unusable_reason

    facts: dict[str, dict[str, Any]] = {}
    for name, module in dsl.DSLS.items():
        if name == "native":
            continue
        version = module.runtime_version()
        facts[name] = {
            "installed": bool(module.runtime_available()),
            "version": str(version) if version is not None else None,
            "package": getattr(module, "PACKAGE", None),
            "unusable": dsl_unusable_reason(name),
        }
        facts[name].update(_dsl_extras(module))
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
        # The tileiras wheel compiles only beside the nvcc/nvvm wheels of its release.
        extras["toolchain"] = module.toolchain()
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
    for override in registry_rows():
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
            wheels = dsl.get("toolchain", {})
            if any(wheels.values()):
                for package, version in wheels.items():
                    row(package, version or "not installed", 4)
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


def cmd_doctor(args: argparse.Namespace) -> int:
    facts = doctor_facts()
    if args.json:
        print(json.dumps(facts, indent=1))
    else:
        _print_doctor(facts)
    return 0
