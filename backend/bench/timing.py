"""Timing of one training step, fenced so every rank measures the same step.

CPU: wall clock (perf_counter) between fences. CUDA: CUDA events recorded on the current stream right after
the opening fence and right after the step, read once the closing event has completed: the device's own
time for the step's queued work, which the host clock would miss (kernels still running when fn returns)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def fence(device: torch.device) -> None:
    """Wait for queued device work, then line the ranks up, so a step's time starts from a common point."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """Run fn between fences; return (its result, seconds). The closing sync waits for device work only."""
    fence(device)
    if device.type == "cuda":
        return _timed_cuda(fn, device)
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _timed_cuda(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    torch.cuda.synchronize(device)  # other streams (NCCL) too, so the next step starts from a quiet device
    return out, start.elapsed_time(end) / 1e3  # elapsed_time is in ms

