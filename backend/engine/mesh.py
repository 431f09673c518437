"""Process group and the device mesh for one rank: named dims (pp, dp, tp), and for expert parallelism the same
mesh with dp unflattened into (dp_mod_ep, ep) (`build_ep_mesh`)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from backend.launch.nccl import group_timeout_s
from backend.spec import Backend, Device, ExperimentSpec
from backend.torch_compat import unflatten_mesh

MESH_DIMS = ("pp", "dp", "tp")
EP_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "tp")
"""Expert parallelism borrows from dp, as torchtitan's ParallelDims splits dp_shard = dp_shard_mod_ep x
dp_shard_in_ep (its `ep` with cp = 1 and etp = tp): dp = dp_mod_ep x ep, ep fastest."""


def pick_backend_device(spec: ExperimentSpec, local_rank: int) -> tuple[str, torch.device]:
    """spec.runtime backend/device, with "auto" = nccl + cuda:LOCAL_RANK when CUDA is present, else gloo + cpu."""
    rt = spec.runtime
    cuda = torch.cuda.is_available()
    device_type = rt.device.value if rt.device != Device.AUTO else ("cuda" if cuda else "cpu")
    if device_type == "cuda" and not cuda:
        raise RuntimeError("spec.runtime.device=cuda but torch.cuda.is_available() is False on this host")
    backend = rt.backend.value if rt.backend != Backend.AUTO else ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and device_type != "cuda":
        raise RuntimeError("backend nccl needs device cuda (nccl has no CPU tensors)")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def init(spec: ExperimentSpec, rank: int, world_size: int, local_rank: int) -> tuple[str, torch.device]:
    backend, device = pick_backend_device(spec, local_rank)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout_s(spec.runtime.timeout_s, backend,
                                                                scheduler_limit=str(spec.runtime.executor) == "slurm")), **kwargs)
    return backend, device


def build_mesh(spec: ExperimentSpec, device: torch.device):  # -> DeviceMesh | None
    """(pp, dp, tp) mesh laid out as ParallelSpec.coords (row-major, tp fastest); None for one rank."""
    p = spec.parallel
    if p.world_size == 1:
        return None
    return init_device_mesh(device.type, (p.pp, p.dp, p.tp), mesh_dim_names=MESH_DIMS)


def build_ep_mesh(spec: ExperimentSpec, mesh):  # -> DeviceMesh
    """`mesh` (pp, dp, tp) viewed as EP_MESH_DIMS = (pp, dp_mod_ep, ep, tp): mesh["dp"] keeps the full data-parallel
    dim (FSDP2 / DDP still shard and reduce over all of dp); ep groups are consecutive dp ranks ({0..ep-1},
    {ep..2ep-1}, ...), expert-replica groups (dp_mod_ep) the ranks holding the same experts ({j, j+ep, ...}).
    Collective (creates process groups): every rank calls it once, in the same order. The ep groups are always
    fresh: a dim spanning the world would otherwise reuse the default group, which DDP's gradient all-reduce
    may use, and that all-reduce and the dispatch all-to-all must not share a gloo group (their order differs
    by rank)."""
    p = spec.parallel
    return unflatten_mesh(mesh, "dp", (p.dp // p.ep, p.ep), EP_MESH_DIMS[1:3],
                          backend_override={"ep": dist.get_backend()})


def env_ranks() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun sets them (1 process when unset)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
