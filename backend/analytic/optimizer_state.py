"""Optimizer state and the optimizer step's temporaries per rank (pure Python).

AdamW: exp_avg + exp_avg_sq fp32 per owned element and a 0-dim fp32 `step` per parameter tensor
(torch/optim/adamw.py `_init_group`); SGD with momentum: one momentum_buffer. On CUDA each state tensor
is its own 512-B-rounded storage and AdamW's `step` lives on the host (backend/analytic/device.py).
Inputs are the owned elements per tensor (`state_bytes`) or their sums (`state_bytes_from_sums`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.device import CPU, CUDA, adamw_step_on_device, storage_bytes
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

STEP_TENSOR_BYTES = 4  # AdamW's per-parameter 0-dim fp32 `step`


def state_bytes_from_sums(*, elements: Num, tensors: Num, cuda_bytes: Num, optimizer: str, device: str) -> Num:
    """Optimizer state of tensors whose owned elements sum to `elements` (`cuda_bytes`: the sum of their
    512-B-rounded fp32 storages, used on CUDA)."""
    states = cuda_bytes if device == CUDA else MASTER_BYTES * elements
    if optimizer != "adamw":
        return states
    step = STEP_TENSOR_BYTES * tensors if adamw_step_on_device(device) else 0
    return 2 * states + step


def state_bytes(elements: list[int] | tuple[int, ...], optimizer: str, device: str = CPU) -> int:
    """Optimizer state of tensors with these owned elements each."""
    cuda = storage_bytes([MASTER_BYTES * n for n in elements], CUDA) if device == CUDA else 0
    return state_bytes_from_sums(elements=sum(elements), tensors=len(elements), cuda_bytes=cuda, optimizer=optimizer,
                                 device=device)


def step_temp_bytes(elements: list[int] | tuple[int, ...], optimizer: str, *, foreach: bool) -> int:
    """Peak temporaries inside optimizer.step (MemTracker tags them as optimizer state), elements in the local
    optimizer's order. Single-tensor AdamW (CPU default) computes denom = (exp_avg_sq.sqrt() / bc2).add_(eps):
    2 temporaries of the current param while the previous denom is still bound; foreach (CUDA default) holds a
    `_foreach_sqrt` copy of every exp_avg_sq. SGD momentum updates in place."""
    if optimizer != "adamw":
        return 0
    if foreach:
        return MASTER_BYTES * sum(elements)
    prev = [0] + list(elements[:-1])
    return MASTER_BYTES * max((a + 2 * b for a, b in zip(prev, elements, strict=False)), default=0)
