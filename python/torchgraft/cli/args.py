"""What every subcommand shares: the parser class, its error, and the parsers of argument values.

Imports nothing of torchgraft.cli's subcommands or of torchgraft.bench, so both may use it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch

__all__ = [
    "PROG",
    "CliError",
    "Parser",
    "parse_device",
    "parse_dtype",
    "parse_list",
    "parse_shapes",
]

PROG = "torchgraft"


class CliError(Exception):
    """A request that cannot run as given; main() prints the message and returns 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line and exit status 2 like every other usage error (argparse prints the usage).
        raise CliError(f"{message} (see '{self.prog} --help')")


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


def parse_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CliError(f"empty list {text!r}")
    return items
