"""torchtitan's loss as its train step runs it (`del pred` before backward), eager or under torch.compile, measured by
this process's peak resident memory (/proc/self/status VmHWM, reset through /proc/self/clear_refs). Inductor's
compiled allocations never reach a dispatch mode, so MemTracker would see the compiled function run eagerly.

Run as its own process (`python -m tests.helpers.compiled_loss_memory [--compiled]`): prints the bytes per logit at the
forward peak, kept for backward, and at the backward peak, as JSON. A process that ran other work first can free
memory of that work during the measurement and shift every figure down (a CI worker measured 0, 0, 2 for 2, 2, 4).
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

N_TOKENS, VOCAB = 8192, 4096
"""64 MiB and larger tensors: above glibc's largest dynamic mmap threshold (32 MiB), so each is its own mapping,
resident while alive and returned when freed."""


def _resident_bytes(key: str) -> int:
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what is resident now (Linux >= 4.0)


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan components/loss.py (e7c0cae)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def bytes_per_logit(compiled: bool) -> list[float]:
    """[forward peak, kept after `del pred`, backward peak] in bytes per logit, above what was resident before."""
    loss_fn = torch.compile(cross_entropy_loss) if compiled else cross_entropy_loss
    x = torch.randn(N_TOKENS, 2, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, N_TOKENS))
    loss_fn((x @ w).unsqueeze(0), labels).backward()  # compiles, and warms the allocator
    x.grad = w.grad = None
    gc.collect()
    gc.disable()
    base = _resident_bytes("VmRSS")
    _reset_peak()
    pred = (x @ w).unsqueeze(0)
    loss = loss_fn(pred, labels)
    forward = _resident_bytes("VmHWM") - base
    del pred
    kept = _resident_bytes("VmRSS") - base
    _reset_peak()
    loss.backward()
    backward = _resident_bytes("VmHWM") - base
    return [b / (N_TOKENS * VOCAB) for b in (forward, kept, backward)]


if __name__ == "__main__":
    print(json.dumps(bytes_per_logit("--compiled" in sys.argv[1:])))
