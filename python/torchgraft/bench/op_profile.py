"""Where one step's time goes: ``torch.profiler``, self time by op.

On CUDA each op's *self device time* is the time of the kernels it launched itself (not through
another op it called); kernels launched outside any ATen op (Triton kernels called from Python,
compiled graphs) count under the innermost profiler range around them (an autograd node such
as ``LigerRMSNormFunctionBackward``, ``CompiledFunction``...), and the rest as ``unattributed``.
On the CPU it is each op's self CPU time.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["OpTime", "StepProfile", "profile_step"]


@dataclass(frozen=True)
class OpTime:
    """One op's share of a step."""

    op: str
    self_ms: float
    calls: int
    share: float
    """``self_ms`` over the step's total."""


@dataclass(frozen=True)
class StepProfile:
    """The top ops of one step by self time."""

    clock: str
    """``"self device time"`` (CUDA) or ``"self CPU time"``."""
    total_ms: float
    """All kernels' time (CUDA) or all ops' self time (CPU) in the step."""
    unattributed_ms: float
    """CUDA kernel time that no profiled op or range launched (0 on the CPU)."""
    ops: list[OpTime]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _self_device_us(event: Any) -> float:
    # torch >= 2.4 names it self_device_time_total; older builds self_cuda_time_total.
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value)


KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"
"""Kineto (the profiler's engine) reads its log threshold from this variable when the first
profile starts; 6 is above its highest level, so it prints nothing."""


@contextlib.contextmanager
def _quiet_profiler(on_cuda: bool) -> Iterator[None]:
    """Profiling the CPU, keep kineto from printing to stderr (unless the user set its level).

    On a machine without a usable GPU, a CUDA build of torch makes kineto print
    ``gpuGetDeviceCount failed with code 35`` and its USDT/STAGE trace lines at each profile:
    nothing is wrong (only CPU events are asked for). The variable is read once per process, at
    the first profile, so it is set for that moment only. Profiling CUDA, kineto's messages may
    matter (CUPTI missing), and they are left alone.
    """
    if on_cuda or KINETO_LOG_LEVEL in os.environ:
        yield
        return
    os.environ[KINETO_LOG_LEVEL] = "6"
    try:
        yield
    finally:
        os.environ.pop(KINETO_LOG_LEVEL, None)


def profile_step(step: Callable[[], object], device: torch.device, *, top: int = 20) -> StepProfile:
    """Profiles one call of ``step()`` (warm it up first) and returns its ``top`` ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    with warnings.catch_warnings(), _quiet_profiler(on_cuda):
        # One profiling cycle: torch's note that events do not accumulate across cycles is moot.
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=activities) as prof:
            step()
            if on_cuda:
                torch.cuda.synchronize(device)
    events = prof.key_averages()
    # Ops (and profiler ranges) are host-side events; kernels are the device-side ones.
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    if on_cuda:
        times = {e.key: (_self_device_us(e), e.count) for e in ops}
        # Device-side events are kernels, copies and memsets, plus each profiler range's span
        # on the GPU timeline (named like the range): count the former only.
        kernels = sum(
            _self_device_us(e)
            for e in events
            if e.device_type == DeviceType.CUDA and e.key not in times
        )
        attributed = sum(t for t, _ in times.values())
        total, unattributed = kernels, max(0.0, kernels - attributed)
        clock = "self device time"
    else:
        times = {e.key: (float(e.self_cpu_time_total), e.count) for e in ops}
        total, unattributed = sum(t for t, _ in times.values()), 0.0
        clock = "self CPU time"
    ranked = sorted(((t, n, key) for key, (t, n) in times.items() if t > 0), reverse=True)
    return StepProfile(
        clock=clock,
        total_ms=total / 1e3,
        unattributed_ms=unattributed / 1e3,
        ops=[
            OpTime(op=key, self_ms=t / 1e3, calls=n, share=t / total if total else 0.0)
            for t, n, key in ranked[:top]
        ],
    )
