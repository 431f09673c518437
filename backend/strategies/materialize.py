"""Meta-device models -> this rank's real shards, and the check that everything a step touches is on ctx.device.

`materialize` runs after every parallelism has been applied to a model built on `meta` (so each parameter
already has its final DTensor / FSDP2 / pipeline-stage form): `to_empty` gives it uninitialised storage on
the device, then `backend.models.gpt.init_weights` writes each parameter from the full tensor the single-
process reference draws (seeded by (seed, name)), keeping only the local slice. Host peak: one full
parameter plus the local shards. The slice is `distribute_tensor(full, mesh, placements, src_data_rank=None)`:
each rank cuts its own piece (Shard, _StridedShard of FSDP2×TP, Replicate) without any communication.

On fake tensors (the full-scale trace, backend/trace) `to_empty` cannot run: `nn.Module._apply` always swaps a
FakeTensor parameter with `torch.utils.swap_tensors`, which refuses a Parameter that FakeTensorMode has attached
a weakref to (every Parameter made in the mode). `to_empty_by_assignment` gives the same result without the swap:
each Parameter object is replaced in its module's `_parameters` (FSDP2 / replicate then re-read theirs, as they
do after `_apply` when the object changes). Nothing may hold the old objects: materialize runs before DDP, the
optimizer and the grad hooks see the parameters, and FSDP2's `ignored_params` is only read inside fully_shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from backend.models.gpt import init_weights, tie_weights
from backend.torch_compat import is_fake_tensor, reset_fsdp_sharded_params


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `full` for `param` (a DTensor's local shard, or all of it)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


def materialize(modules: list[nn.Module], device: torch.device, seed: int) -> None:
    """Give every meta parameter storage on `device` and the reference's initial values (local slices only)."""
    for m in modules:
        if any(is_fake_tensor(_local(t)) for t in [*m.parameters(), *m.buffers()]):
            to_empty_by_assignment(m, device)
        else:
            m.to_empty(device=device)
        tie_weights(m)
        init_weights(m, seed, local_slice=local_slice)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the per-parameter temporaries must not sit in the reserved pool


def to_empty_by_assignment(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device=device)` with every parameter and buffer replaced instead of swapped (fake tensors).
    A Parameter shared by several modules (tied weights) stays one object."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # FSDPModule._apply does the same first: the sharded parameters are the registered ones
    new: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for m in module.modules():
            for key, p in m._parameters.items():
                if p is not None:
                    if id(p) not in new:
                        new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    m._parameters[key] = new[id(p)]
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = torch.empty_like(b, device=device)
    reset_fsdp_sharded_params(module)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def misplaced(device: torch.device, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None,
              batch: Iterable[torch.Tensor] = ()) -> list[str]:
    """'name (where)' of every parameter, gradient, buffer, DTensor local shard, optimizer state tensor and
    batch tensor not on `device`. AdamW keeps its 0-dim `step` counter on the CPU unless capturable/fused
    (torch/optim/adamw.py), by design: that one is allowed."""
    bad: list[str] = []

    def check(name: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        local = _local(t)
        if local.device != device:
            bad.append(f"{name} ({'DTensor local shard ' if local is not t else ''}on {local.device})")

    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            check(f"module {i} parameter {n}", p)
            check(f"module {i} grad of {n}", p.grad)
        for n, b in m.named_buffers():
            check(f"module {i} buffer {n}", b)
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its state in .optim
        for j, state in enumerate(inner.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0 and v.device.type == "cpu"):
                    check(f"optimizer state {j}.{k}", v)
    for j, t in enumerate(batch):
        check(f"batch tensor {j}", t)
    return bad


def check_placement(device: torch.device, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None,
                    batch: Iterable[torch.Tensor] = ()) -> None:
    """Raise naming every tensor a step would touch that is not on `device` (catches a missing .to(device)
    before NCCL would fail with a device mismatch, and a parameter left on meta)."""
    bad = misplaced(device, modules, optimizer, batch)
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise RuntimeError(f"{len(bad)} tensor(s) not on {device}: {shown}")
