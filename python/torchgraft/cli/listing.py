"""``torchgraft list``: every native graft, registry override and torch._native override."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["cmd_list", "list_rows", "registry_rows"]


def registry_rows() -> list[dict[str, Any]]:
    import importlib

    from torchgraft.control import gate_notes

    registry = importlib.import_module("torchgraft.registry")  # looked up now: tests swap it

    notes = gate_notes()
    rows = []
    for o in registry.list_overrides():
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
    rows += registry_rows()
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


def cmd_list(args: argparse.Namespace) -> int:
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
