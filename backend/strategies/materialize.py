"""Meta-device models -> this rank's real shards, and the check that everything a step touches is where it belongs
(ctx.placement: ctx.device, the model states on the host under offload=params).

`materialize` runs after every parallelism has been applied to a model built on `meta` (so each parameter
already has its final DTensor / FSDP2 / pipeline-stage form): `to_empty` gives it uninitialised storage on
the device, then `backend.models.gpt.init_weights` writes each parameter from the full tensor the single-
process reference draws (seeded by (seed, name)), keeping only the local slice. Host peak: one full
parameter plus the local shards. The slice is `distribute_tensor(full, mesh, placements, src_data_rank=None)`:
each rank cuts its own piece (Shard, _StridedShard of FSDP2×TP, Replicate) without any communication.
Under FSDP2's CPUOffloadPolicy the sharded parameters must be materialized on the host (FSDP2 checks it at its
lazy init, and all-gathers them to the device itself; torchtitan does the same: `to_empty(device="cpu")` when
offloading, buffers on the device): the parameters go to `placement.states`, the buffers to `placement.compute`,
and a host-held shard is cut on the host (`torch_compat.host_chunk`), never sent through the device.

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
from backend.strategies.context import Placement
from backend.torch_compat import host_chunk, is_fake_tensor, reset_fsdp_sharded_params


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `full` for `param` (a DTensor's local shard, or all of it)."""
    if isinstance(param, DTensor):
        if param.to_local().device.type != param.device_mesh.device_type:  # a host-held shard (CPUOffloadPolicy)
            piece = host_chunk(full, param.device_mesh, param.placements)
            if piece is not None:
                return piece
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return full


def materialize(modules: list[nn.Module], where: Placement | torch.device, seed: int) -> None:
    """Give every meta parameter storage on `where.states`, every buffer on `where.compute`, and the reference's
    initial values (local slices only)."""
    where = where if isinstance(where, Placement) else Placement.on(where)
    for m in modules:
        if any(is_fake_tensor(_local(t)) for t in [*m.parameters(), *m.buffers()]):
            to_empty_by_assignment(m, where)
        else:
            m.to_empty(device=where.states)
            if where.compute != where.states:
                _empty_buffers(m, where.compute)
        tie_weights(m)
        init_weights(m, seed, local_slice=local_slice)
    if where.compute.type == "cuda":
        torch.cuda.empty_cache()  # the per-parameter temporaries must not sit in the reserved pool


def _empty_buffers(module: nn.Module, device: torch.device) -> None:
    """Uninitialised buffers on `device` (init_weights' reset_buffers writes them)."""
    for m in module.modules():
        for key, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[key] = torch.empty_like(b, device=device)


def to_empty_by_assignment(module: nn.Module, where: Placement | torch.device) -> None:
    """`module.to_empty(device=...)` with every parameter (to `where.states`) and buffer (to `where.compute`)
    replaced instead of swapped (fake tensors). A Parameter shared by several modules (tied weights) stays one
    object."""
    where = where if isinstance(where, Placement) else Placement.on(where)
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
                        new[id(p)] = nn.Parameter(torch.empty_like(p, device=where.states),
                                                  requires_grad=p.requires_grad)
                    m._parameters[key] = new[id(p)]
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = torch.empty_like(b, device=where.compute)
    reset_fsdp_sharded_params(module)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def misplaced(where: Placement | torch.device, modules: Iterable[nn.Module],
              optimizer: torch.optim.Optimizer | None = None, batch: Iterable[torch.Tensor] = ()) -> list[str]:
    """'name (where)' of every parameter, gradient, DTensor local shard and optimizer state tensor not on
    `where.states`, and every buffer and batch tensor not on `where.compute` (a bare device: both). AdamW keeps
    its 0-dim `step` counter on the CPU unless capturable/fused (torch/optim/adamw.py), by design: that one is
    allowed."""
    where = where if isinstance(where, Placement) else Placement.on(where)
    bad: list[str] = []

    def check(name: str, t: torch.Tensor | None, device: torch.device) -> None:
        if t is None:
            return
        local = _local(t)
        if local.device != device:
            bad.append(f"{name} ({'DTensor local shard ' if local is not t else ''}on {local.device})")

    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            check(f"module {i} parameter {n}", p, where.states)
            check(f"module {i} grad of {n}", p.grad, where.states)
        for n, b in m.named_buffers():
            check(f"module {i} buffer {n}", b, where.compute)
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its state in .optim
        for j, state in enumerate(inner.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0 and v.device.type == "cpu"):
                    check(f"optimizer state {j}.{k}", v, where.states)
    for j, t in enumerate(batch):
        check(f"batch tensor {j}", t, where.compute)
    return bad


def check_placement(where: Placement | torch.device, modules: Iterable[nn.Module],
                    optimizer: torch.optim.Optimizer | None = None, batch: Iterable[torch.Tensor] = ()) -> None:
    """Raise naming every tensor a step would touch that is not where it belongs (catches a missing .to(device)
    before NCCL would fail with a device mismatch, and a parameter left on meta)."""
    where = where if isinstance(where, Placement) else Placement.on(where)
    bad = misplaced(where, modules, optimizer, batch)
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        states = f" (model states: {where.states})" if where.states != where.compute else ""
        raise RuntimeError(f"{len(bad)} tensor(s) not on {where.compute}{states}: {shown}")
