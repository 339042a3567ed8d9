"""Reports layers that carry a kernel-hub tag (``use_kernel_forward_from_hub``) which no
adopter serves, so the report shows what a model offers that this build leaves alone."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from torchgraft.adopt.base import Candidate, Context, hub_name
from torchgraft.adopt.report import SKIPPED


class HubLayerReporter:
    """Hub-tagged modules no other adopter claimed (always skipped, with the reason)."""

    kind = "hub_layer"
    finds = "any module whose class has a kernel-hub tag, not claimed above"

    def candidates(self, model: nn.Module, ctx: Context) -> Iterator[Candidate]:
        for path, module in model.named_modules():
            tag = hub_name(module)
            if tag is None or id(module) in ctx.claimed:
                continue
            yield Candidate(
                self.kind,
                path,
                type(module).__name__,
                module,
                "forward",
                "forward",
                hub_name=tag,
                status=SKIPPED,
                reason=f"no torchgraft adopter for hub layer {tag!r} in this build",
            )
