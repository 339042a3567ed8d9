"""transformers' own kernel mechanism, served offline: torchgraft layer classes handed to the
``kernels`` package's ``kernelize`` for layers tagged ``use_kernel_forward_from_hub(...)``.

``kernels`` maps a hub layer name to a "repository" — any object with ``load()`` returning a
stateless layer class whose ``forward`` replaces the module's — inside ``use_kernel_mapping``.
Ours return local classes (no Hub access, nothing downloaded). Each verified module is kernelized
on its own with a mapping of exactly one layer class (its verified variant), because one hub name
(``"RMSNorm"``) covers classes with different numerics (Llama's and Qwen3.5's, for instance).
Only imported when the ``kernels`` package is used.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

_layers: dict[Callable[..., object], type[nn.Module]] = {}
_repositories: dict[type[nn.Module], InProcessRepository] = {}


def available() -> bool:
    """Whether the ``kernels`` package can be imported (a blocked import counts as absent)."""
    try:
        return importlib.util.find_spec("kernels") is not None
    except (ImportError, ValueError):
        return False


class InProcessRepository:
    """A ``kernels`` repository that loads a torchgraft layer class from this process."""

    def __init__(self, layer: type[nn.Module]) -> None:
        self.layer = layer

    def load(self) -> type[nn.Module]:
        """The layer class (what ``kernels`` calls to fetch it; nothing is downloaded)."""
        return self.layer

    def __str__(self) -> str:
        return f"torchgraft layer {self.layer.__name__}"


def layer_class(name: str, forward: Callable[..., object]) -> type[nn.Module]:
    """The stateless layer class ``kernels`` installs: only ``forward`` (reading the module's own
    attributes) and the two capability flags ``kernels`` checks."""
    if forward not in _layers:
        _layers[forward] = type(
            f"Torchgraft{name}",
            (nn.Module,),
            {"forward": forward, "can_torch_compile": True, "has_backward": True},
        )
    return _layers[forward]


def kernelize(module: nn.Module, hub_name: str, forward: Callable[..., object]) -> None:
    """Install ``forward`` on ``module`` through ``kernels.kernelize`` (the module only)."""
    import kernels

    layer = layer_class(hub_name, forward)
    repository = _repositories.setdefault(layer, InProcessRepository(layer))
    device = _device_type(module)
    mapping = {hub_name: {device: repository}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(
            module,
            mode=kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE,
            device=device,
            use_fallback=False,
        )


def _device_type(module: nn.Module) -> str:
    tensor = next(module.parameters(), None)
    device = tensor.device.type if tensor is not None else "cpu"
    if device == "cuda" and torch.version.hip is not None:
        return "rocm"
    return device
