"""Model adoption: route a model's own layers to operators torchgraft grafts, verified, reversibly.

Most models write RMSNorm, gated MLPs, RoPE and their loss by hand, so none of it reaches an
operator a graft sits under. :func:`adopt` finds those layers (a table of adopters: by kernel-hub
tag, by structure, by ``nn`` class), checks a replacement against each layer's own forward on a
small random probe (forward and backward), and installs it only where they agree;
:func:`unadopt` restores every forward. Adopted layers run torchgraft's operators while it is
enabled, and re-check on every call what was verified (:mod:`torchgraft.adopt.guard`). This
package knows model idioms and maps them to aten and ``torchgraft.functional`` ops; it imports
no kernel and computes nothing itself.

Note: ``torchgraft.adopt`` (the attribute) is the function; import submodules by their full name
(``from torchgraft.adopt.report import AdoptionRow``).
"""

from torchgraft.adopt.core import ADOPTERS, adopt, unadopt
from torchgraft.adopt.guard import AdoptionFallbackWarning
from torchgraft.adopt.report import AdoptionReport, AdoptionRow

__all__ = [
    "ADOPTERS",
    "AdoptionFallbackWarning",
    "AdoptionReport",
    "AdoptionRow",
    "adopt",
    "unadopt",
]
