"""Optimizer state and the optimizer step's temporaries per rank (pure Python).

AdamW: exp_avg + exp_avg_sq fp32 per owned element and a 0-dim fp32 `step` per parameter tensor
(torch/optim/adamw.py `_init_group`); SGD with momentum: one momentum_buffer. On CUDA each state tensor
is its own 512-B-rounded storage and AdamW's `step` lives on the host (backend/analytic/device.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic import device as D
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.sharding import LocalParam

STEP_TENSOR_BYTES = 4  # AdamW's per-parameter 0-dim fp32 `step`


def _optimizer_bytes(params: list[LocalParam], optimizer: str, *, fsdp: bool, device: str = D.CPU) -> int:
    """AdamW exp_avg + exp_avg_sq (fp32) + a 0-dim `step` per tensor; SGD one momentum_buffer. On CUDA every
    state tensor is its own 512-B-rounded storage, and AdamW's `step` lives on the host (device.py)."""
    states = [MASTER_BYTES * (q.real_numel if fsdp else q.local_numel) for q in params]
    if str(optimizer) != "adamw":
        return D.storage_bytes(states, device)
    step = STEP_TENSOR_BYTES * len(params) if D.adamw_step_on_device(device) else 0
    return 2 * D.storage_bytes(states, device) + step


def optimizer_temp_bytes(params: list[LocalParam], optimizer: str, *, fsdp: bool, foreach: bool) -> int:
    """Peak temporaries inside optimizer.step (MemTracker tags them as optimizer state), params in the
    local optimizer's order. Single-tensor AdamW (CPU default) computes denom = (exp_avg_sq.sqrt() / bc2)
    .add_(eps): 2 temporaries of the current param while the previous denom is still bound; foreach
    (CUDA default) holds a `_foreach_sqrt` copy of every exp_avg_sq. SGD momentum updates in place."""
    if str(optimizer) != "adamw":
        return 0
    elems = [q.real_numel if fsdp else q.local_numel for q in params]
    if foreach:
        return MASTER_BYTES * sum(elems)
    prev = [0] + elems[:-1]
    return MASTER_BYTES * max((a + 2 * b for a, b in zip(prev, elems)), default=0)
