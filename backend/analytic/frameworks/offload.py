"""Where model states live under torch FSDP2's CPUOffloadPolicy (spec.parallel.offload = params), pure Python.

FSDP2 with `CPUOffloadPolicy` keeps each rank's sharded parameters and sharded gradients on the host and runs
the optimizer step there (torch docs, `torch.distributed.fsdp.CPUOffloadPolicy`; ZeRO-Offload, Ren et al. 2021
§4: fp32 states and the update on the CPU, parameters copied to the device for compute). Host-resident per
rank: sharded params + sharded grads + optimizer states (K = 2 Adam moments or 1 SGD buffer, 4 B each, over
the same shard); device-resident: everything the step allocates on the compute device (the unsharded
parameters of the units in use, unsharded gradients before their reduce-scatter, activations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.sharding import local_params
from backend.spec.choices import Optimizer

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

FP32_BYTES = 4
OPT_STATES = {"adamw": 2, "sgd": 1}


def host_bytes(spec: ExperimentSpec, rank: int) -> int:
    """Host-resident bytes of this rank under offload=params: sharded params, their grads, optimizer states."""
    params = local_params(spec, rank)
    shard = sum(q.storage_numel for q in params)
    # torch AdamW: one step tensor per param
    steps = FP32_BYTES * len(params) if spec.train.optimizer == Optimizer.ADAMW else 0
    return FP32_BYTES * shard * (2 + OPT_STATES[str(spec.train.optimizer)]) + steps


def split(spec: ExperimentSpec, rank: int, total_bytes: int) -> dict[str, int]:
    """{"host_bytes", "device_bytes"} of a predicted per-rank total (ShardLab's estimate at the activation peak)."""
    host = host_bytes(spec, rank)
    return {"host_bytes": host, "device_bytes": max(total_bytes - host, 0)}
