"""Wall-clock timing of one training step, fenced so every rank measures the same step."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

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
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def step_s_median(per_rank_step_s: list[list[float]]) -> float | None:
    """Median over steps of the slowest rank's time for that step (a step ends when its last rank does)."""
    if not per_rank_step_s or not all(per_rank_step_s):
        return None
    n = min(len(s) for s in per_rank_step_s)
    return statistics.median(max(s[i] for s in per_rank_step_s) for i in range(n))
