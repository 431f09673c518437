"""How the operation probe times one operation: device time, warm-up first, median of repeats, rotating inputs.

CUDA: a pair of CUDA events around each repeat on the current stream, read after the end event completes
(the device's own time for the queued kernels). A repeat is a burst of back-to-back calls, enough for about
BURST_S of device time: the GPU records the start event at once and then waits for the first call's host launch,
so a single-call span would hold that launch too (probes before this timing, `measured.timing` absent, are
corrected for it by analytic/steptime/op_tables.py); in a burst only the first call's launch is inside, shared by
all. CPU: perf_counter around each call. Inputs are random (never zeros: a zero operand can take a faster path in some
kernels), and where one input set would sit in the L2 cache the probe allocates several and rotates through them, so
each repeat reads from HBM as a training step does (the same idea as triton.testing.do_bench's cache flush, without the
flush kernel's own time in the span).

A `Deadline` bounds a whole table: each measurement checks it first, and a table that runs out of time keeps
what it measured and says so (`truncated`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_L2_BYTES = 32 * 2**20
"""Stand-in for the last-level cache size on the CPU (no portable query)."""
MAX_ROTATION = 16
"""At most this many input sets per measurement (memory bound: see rotation_count)."""
BURST_S = 1e-3
"""Device seconds one CUDA repeat aims at (calls per burst = BURST_S / one call, 1..MAX_BURST)."""
MAX_BURST = 64
TIMING = "burst"
"""What a probe records as `measured.timing` (op_profile): spans of bursts, no host launch inside per call."""


@dataclass
class Deadline:
    """Monotonic deadline of one probe table."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + max(0.0, seconds))

    def left_s(self) -> float:
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return self.left_s() <= 0


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20)
    return CPU_L2_BYTES


def rotation_count(bytes_per_set: int, device: torch.device, budget_bytes: int) -> int:
    """Input sets to rotate through so that together they exceed twice the L2 cache, within budget_bytes."""
    want = -(-2 * l2_bytes(device) // max(1, bytes_per_set))
    fits = max(1, budget_bytes // max(1, bytes_per_set))
    return int(max(1, min(want, fits, MAX_ROTATION)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_repeat(fns: list[Callable[[], object]], device: torch.device, first: int = 0, calls: int = 1) -> float:
    """Seconds per call of `calls` back-to-back calls, rotating over fns from index `first`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[(first + i) % len(fns)]()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls  # ms -> s
    t0 = time.perf_counter()
    for i in range(calls):
        fns[(first + i) % len(fns)]()
    return (time.perf_counter() - t0) / calls


def median_s(fns: list[Callable[[], object]], device: torch.device, *, warmup: int = 2, repeats: int = 5,
             target_s: float = 0.05) -> float:
    """Median seconds of one call, rotating over `fns` (one per input set). Warm-up calls first (kernel selection,
    cuBLAS/cuDNN autotuning, lazy allocation); more repeats, up to 4x, when one call is much shorter than target_s
    (short kernels are noisier)."""
    for k in range(warmup):
        fns[k % len(fns)]()
    synchronize(device)
    first = _one_repeat(fns, device)
    calls = int(min(MAX_BURST, max(1, BURST_S / first))) if device.type == "cuda" and first > 0 else 1
    n = repeats if first <= 0 else int(min(4 * repeats, max(repeats, target_s / (first * calls))))
    times = [_one_repeat(fns, device, first=k * calls, calls=calls) for k in range(n)]
    return statistics.median(times)


def randn(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, *, requires_grad: bool = False
          ) -> torch.Tensor:
    """Random normal values of `dtype` (fp8 dtypes: drawn in bf16 and cast), scaled to stay finite in 16 bit."""
    draw = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) else torch.bfloat16
    t = torch.randn(shape, device=device, dtype=draw).to(dtype)
    return t.requires_grad_(requires_grad) if requires_grad else t
