"""What :func:`torchgraft.adopt` did to a model: one row per layer it looked at, as a table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torchgraft import control

ADOPTED = "adopted"
"""The layer now runs the replacement (verified equal on a probe first)."""
NATIVE = "native"
"""The layer already calls an operator that torchgraft grafts; nothing to change."""
ALREADY = "already adopted"
"""An earlier :func:`torchgraft.adopt` call adopted the layer; left as it is."""
SKIPPED = "skipped"
"""Left exactly as it was; ``reason`` says why."""
KILLED = "not adopted: kill switch (TORCHGRAFT_DISABLE is set)"
"""The reason of every row while the kill switch is set (status :data:`SKIPPED`)."""
NOT_ENABLED = (
    "torchgraft is not enabled: adopted layers run the model's own code until torchgraft.enable()"
)


@dataclass(frozen=True)
class AdoptionRow:
    """One layer (a module, a model's loss, a module-global function) and what happened to it."""

    path: str
    """Where it sits: the module's qualified name in the model (``"model.norm"``; ``""`` is the
    model itself) or, for a module-global function, ``"<python module>.<name>"``."""
    layer: str
    """Its class (or function) name, e.g. ``"LlamaRMSNorm"``."""
    kind: str
    """The adopter that looked at it: ``"rms_norm"``, ``"gated_mlp"``, ``"rope"``,
    ``"causal_lm_loss"``, or ``"hub_layer"`` (a kernel-hub tagged layer no adopter serves)."""
    status: str
    """:data:`ADOPTED`, :data:`NATIVE`, :data:`ALREADY` or :data:`SKIPPED`."""
    route: str = ""
    """The variant chosen and the operator it calls, e.g.
    ``"llama-style -> aten::_fused_rms_norm"``."""
    via: str = ""
    """How the replacement is installed: ``"forward"`` (the module's own ``forward``),
    ``"kernels"`` (the ``kernels`` package's ``kernelize``), ``"loss_function"`` or ``"global"``."""
    reason: str = ""
    """Why a layer was skipped, or a note on an adopted one."""
    max_err: float | None = None
    """The largest relative error (norm of the difference over the norm of the model's own
    result) over the probe's outputs and gradients, or ``None`` when nothing was compared."""


@dataclass
class AdoptionReport:
    """The result of :func:`torchgraft.adopt`: every layer it looked at (:attr:`rows`).

    ``print(report)`` shows a table with one line per (layer class, outcome);
    :meth:`table` with ``grouped=False`` shows one line per layer. Adopted layers run
    torchgraft's operators only while :func:`torchgraft.enable` is in effect: the table says so
    when it is not.
    """

    rows: list[AdoptionRow] = field(default_factory=list)

    @property
    def adopted(self) -> list[AdoptionRow]:
        """The rows of layers that now run a replacement."""
        return [r for r in self.rows if r.status == ADOPTED]

    @property
    def skipped(self) -> list[AdoptionRow]:
        """The rows of layers left as they were, each with its reason."""
        return [r for r in self.rows if r.status == SKIPPED]

    def count(self, kind: str | None = None, status: str = ADOPTED) -> int:
        """How many rows have ``status`` (and ``kind``, when given)."""
        return sum(1 for r in self.rows if r.status == status and kind in (None, r.kind))

    def table(self, grouped: bool = True) -> str:
        """The report as a plain-text table.

        Args:
            grouped: one line per (kind, layer class, status, route, reason) with a count
                (default), or one line per layer with its path.
        """
        header = f"torchgraft.adopt: {len(self.adopted)} of {len(self.rows)} layers adopted"
        if any(r.reason == KILLED for r in self.rows):
            header += " (kill switch: TORCHGRAFT_DISABLE is set)"
        elif self.adopted and not control.is_enabled():
            header += f"\nnote: {NOT_ENABLED}"
        if not self.rows:
            return header
        if grouped:
            counts: Counter[tuple[str, ...]] = Counter()
            worst: dict[tuple[str, ...], float] = {}
            for r in self.rows:
                key = (r.kind, r.layer, r.status, r.route, r.via, r.reason)
                counts[key] += 1
                if r.max_err is not None:
                    worst[key] = max(worst.get(key, 0.0), r.max_err)
            lines = [
                (kind, layer, str(n), status, route, via, _err(worst.get(key)), reason)
                for key, n in counts.items()
                for kind, layer, status, route, via, reason in [key]
            ]
            titles = ("kind", "layer", "count", "status", "route", "via", "max err", "note")
        else:
            lines = [
                (
                    r.kind,
                    r.path or "<model>",
                    r.layer,
                    r.status,
                    r.route,
                    r.via,
                    _err(r.max_err),
                    r.reason,
                )
                for r in self.rows
            ]
            titles = ("kind", "path", "layer", "status", "route", "via", "max err", "note")
        return header + "\n" + _render(titles, lines)

    def __str__(self) -> str:
        return self.table()


def _err(err: float | None) -> str:
    return "" if err is None else f"{err:.1e}"


def _render(titles: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(t), *(len(line[i]) for line in lines)) for i, t in enumerate(titles)]
    # The last column (the note) is left unpadded so long reasons do not widen every line.
    widths[-1] = 0

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * max(w, len(t)) for w, t in zip(widths, titles, strict=True))
    return "\n".join([fmt(titles), rule, *(fmt(line) for line in lines)])
