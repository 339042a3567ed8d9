"""The ways ``torchgraft bench model`` runs a training step: stock, torchgraft, compile, Liger.

A variant is applied to its own model (built fresh from the benchmark's seed) and says what
process-wide state its steps run under. Nothing a variant does reaches another one:

- torchgraft's grafts are process-wide: a torchgraft variant's steps run inside
  ``torchgraft.enabled()``, every other variant's with torchgraft disabled.
- ``torchgraft.adopt(model)`` changes only that model; ``unadopt`` undoes it at the end.
- ``torch.compile`` wraps only that model (dynamo's caches are keyed by code and guarded, so
  the eager variants never run compiled code).
- Liger-Kernel's ``apply_liger_kernel_to_<family>(model=...)`` (the family's ``liger``) patches
  the model instance *and* module globals (RoPE, the RMSNorm and MLP classes,
  ``torch.nn.functional.cross_entropy``).
  The global patches are caught and undone right away (:mod:`.patches`) and installed again
  only around the Liger variant's own steps; the instance patches belong to its own model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import torchgraft

from . import model_zoo, patches
from .routes import module_available

__all__ = ["VARIANTS", "WATCHED_MODULES", "Prepared", "Setting", "Variant", "watched_namespaces"]


@dataclass(frozen=True)
class Setting:
    """What every variant of one run shares."""

    device: torch.device
    family: str
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    """torch.compile's ``mode`` (None: its default)."""


@dataclass
class Prepared:
    """A variant applied to one model."""

    call: Callable[..., Any]
    """What a training step calls with ``input_ids=, labels=``: the model or its compiled form."""
    active: Callable[[], contextlib.AbstractContextManager[object]]
    """The process-wide state the variant's steps run under (entered around each phase)."""
    undo: Callable[[], None] = lambda: None
    """Removes what the variant changed on the model (called once, at the end)."""
    undo_restores_model: bool = True
    """Whether the model's modules are as built once ``undo`` ran (checked when True)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """What was applied, for the report (JSON-ready)."""


@dataclass(frozen=True)
class Variant:
    """One way to run the training step."""

    name: str
    """Name in tables, JSON and ``--variants``."""
    summary: str
    unavailable: Callable[[Setting], str | None]
    """Why the variant cannot run in this setting, or None."""
    prepare: Callable[[torch.nn.Module, Setting], Prepared]
    grafts: bool
    """Whether torchgraft is on in its steps (the others must show no graft calls)."""


WATCHED_MODULES = (
    "torch.nn.functional",
    "torch.nn.modules.loss",
    "transformers.modeling_utils",
    "transformers.loss.loss_utils",
    "transformers.integrations.hub_kernels",
)
"""Modules (with their classes) whose attributes model-patching libraries assign to; the
family's modeling module is watched too."""


def watched_namespaces(model: torch.nn.Module) -> list[Any]:
    """The modules and classes the benchmark checks are left as they were (see
    :data:`WATCHED_MODULES`), including ``model``'s modeling module and transformers' classes
    it derives from."""
    targets = patches.namespaces_for([*WATCHED_MODULES, type(model).__module__])
    # transformers' own base classes; not torch.nn.Module, which dynamo instruments once
    # (its mutation tracking) on first use: that is torch.compile's, not a variant's leak.
    targets.extend(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    return targets


# ---- process-wide state around a variant's steps ------------------------------------------------


@contextlib.contextmanager
def _torchgraft_off() -> Iterator[None]:
    torchgraft.disable()
    yield


def _always(_setting: Setting) -> str | None:
    return None


# ---- stock --------------------------------------------------------------------------------------


def _prepare_stock(model: torch.nn.Module, _setting: Setting) -> Prepared:
    return Prepared(call=model, active=_torchgraft_off)


# ---- torchgraft ---------------------------------------------------------------------------------


def _report_json(report: object) -> Any:
    to_json = getattr(report, "to_json", None)
    if callable(to_json):
        return to_json()
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    return str(report)


def _adopt(
    model: torch.nn.Module,
) -> tuple[
    dict[str, Any], Callable[[], contextlib.AbstractContextManager[None]], Callable[[], None]
]:
    """``torchgraft.adopt(model)``: its report (as notes), the context its steps run in, and how
    to undo it.

    adopt() replaces some module-global functions (transformers' ``apply_rotary_pos_emb``) for
    the whole process while the model is adopted; like Liger's patches they are recorded and
    installed only around this variant's own steps, so the other variants run as shipped.
    """
    report: list[object] = []

    def adopt() -> None:
        with torchgraft.enabled():
            report.append(torchgraft.adopt(model))

    recorded = patches.record(watched_namespaces(model), adopt)

    @contextlib.contextmanager
    def active() -> Iterator[None]:
        with torchgraft.enabled(), patches.applied(recorded):
            yield

    notes = {
        "adoption": _report_json(report[0]),
        "global_patches": [patches.where(p) for p in recorded],
    }
    return notes, active, lambda: torchgraft.unadopt(model)


def _prepare_torchgraft(model: torch.nn.Module, _setting: Setting) -> Prepared:
    notes, active, undo = _adopt(model)
    return Prepared(call=model, active=active, undo=undo, notes=notes)


# ---- torch.compile ------------------------------------------------------------------------------


def _compile(model: torch.nn.Module, setting: Setting) -> tuple[Callable[..., Any], dict[str, Any]]:
    compiled = torch.compile(model, backend=setting.compile_backend, mode=setting.compile_mode)
    return compiled, _compile_notes(setting)


def _compile_notes(setting: Setting) -> dict[str, Any]:
    notes: dict[str, Any] = {"compile_backend": setting.compile_backend}
    if setting.compile_mode is not None:
        notes["compile_mode"] = setting.compile_mode
    return notes


def _prepare_compile(model: torch.nn.Module, setting: Setting) -> Prepared:
    call, notes = _compile(model, setting)
    return Prepared(call=call, active=_torchgraft_off, notes=notes)


def _prepare_compile_torchgraft(model: torch.nn.Module, setting: Setting) -> Prepared:
    notes, active, undo = _adopt(model)
    call, compile_notes = _compile(model, setting)
    return Prepared(call=call, active=active, undo=undo, notes=notes | compile_notes)


def _compile_layers(model: torch.nn.Module, setting: Setting) -> dict[str, Any]:
    """Regional compilation as torchtitan does it: each decoder layer compiled on its own (one
    graph reused by every layer), the embedding, final norm and head eager."""
    layers = model.get_decoder().layers
    for layer in layers:
        layer.compile(backend=setting.compile_backend, mode=setting.compile_mode)
    return _compile_notes(setting) | {"compiled_layers": len(layers)}


def _prepare_compile_regional(model: torch.nn.Module, setting: Setting) -> Prepared:
    notes = _compile_layers(model, setting)
    # nn.Module.compile has no undo: the model is the variant's own and is dropped.
    return Prepared(call=model, active=_torchgraft_off, notes=notes, undo_restores_model=False)


def _prepare_compile_regional_torchgraft(model: torch.nn.Module, setting: Setting) -> Prepared:
    notes, active, undo = _adopt(model)
    notes = notes | _compile_layers(model, setting)
    return Prepared(call=model, active=active, undo=undo, notes=notes, undo_restores_model=False)


# ---- Liger-Kernel -------------------------------------------------------------------------------


def _liger_unavailable(setting: Setting) -> str | None:
    if model_zoo.FAMILIES[setting.family].liger is None:
        return f"Liger-Kernel has no integration for {setting.family}"
    if not module_available("liger_kernel"):
        return "liger_kernel is not installed (pip install liger-kernel)"
    if setting.device.type != "cuda":
        return "Liger-Kernel's Triton kernels run on CUDA GPUs"
    if not module_available("triton"):
        return "triton is not installed (Liger-Kernel's kernels are Triton)"
    return _liger_import_error()


@functools.cache
def _liger_import_error() -> str | None:
    """Why Liger's transformers integration cannot be imported here, or None (imports it)."""
    try:
        import liger_kernel.transformers.monkey_patch  # noqa: F401
    except Exception as error:  # any import failure means: not usable here, and why
        return f"liger_kernel cannot be imported: {type(error).__name__}: {error}"
    return None


def _liger(fused_linear_cross_entropy: bool) -> Callable[[torch.nn.Module, Setting], Prepared]:
    def prepare(model: torch.nn.Module, setting: Setting) -> Prepared:
        from liger_kernel.transformers import monkey_patch

        function = model_zoo.FAMILIES[setting.family].liger
        apply = getattr(monkey_patch, function or "", None)
        if apply is None:
            raise RuntimeError(f"this liger_kernel has no {function}")
        options = {
            "fused_linear_cross_entropy": fused_linear_cross_entropy,
            "cross_entropy": not fused_linear_cross_entropy,
        }
        recorded = patches.record(watched_namespaces(model), lambda: apply(model=model, **options))

        @contextlib.contextmanager
        def active() -> Iterator[None]:
            torchgraft.disable()
            with patches.applied(recorded):
                yield

        arguments = ", ".join(f"{k}={v}" for k, v in options.items())
        notes = {
            "liger_function": f"{function}(model=model, {arguments})",
            "global_patches": [patches.where(p) for p in recorded],
        }
        # Liger has no undo for the instance; the model is the variant's own and is dropped.
        return Prepared(call=model, active=active, notes=notes, undo_restores_model=False)

    return prepare


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "stock",
            "transformers as shipped, eager, torchgraft off: the reference",
            _always,
            _prepare_stock,
            grafts=False,
        ),
        Variant(
            "stock-again",
            "stock once more on a fresh model from the same seed: the run-to-run noise",
            _always,
            _prepare_stock,
            grafts=False,
        ),
        Variant(
            "torchgraft",
            "torchgraft.enable() + torchgraft.adopt(model)",
            _always,
            _prepare_torchgraft,
            grafts=True,
        ),
        Variant("compile", "torch.compile(model)", _always, _prepare_compile, grafts=False),
        Variant(
            "compile+torchgraft",
            "torch.compile of the adopted model, torchgraft enabled",
            _always,
            _prepare_compile_torchgraft,
            grafts=True,
        ),
        Variant(
            "compile-regional",
            "torch.compile of each decoder layer (torchtitan's regional compilation)",
            _always,
            _prepare_compile_regional,
            grafts=False,
        ),
        Variant(
            "compile-regional+torchgraft",
            "the adopted model's decoder layers compiled one by one, torchgraft enabled",
            _always,
            _prepare_compile_regional_torchgraft,
            grafts=True,
        ),
        Variant(
            "liger-flce",
            "Liger-Kernel's defaults: RoPE, RMSNorm, SwiGLU/GeGLU, fused linear cross-entropy",
            _liger_unavailable,
            _liger(fused_linear_cross_entropy=True),
            grafts=False,
        ),
        Variant(
            "liger-ce",
            "Liger-Kernel: RoPE, RMSNorm, SwiGLU/GeGLU, cross-entropy (logits materialized)",
            _liger_unavailable,
            _liger(fused_linear_cross_entropy=False),
            grafts=False,
        ),
    )
}
"""Every variant, in the order they run (``stock`` first: the others are compared with it)."""
