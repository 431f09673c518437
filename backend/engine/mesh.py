"""Process group and the device mesh for one rank: named dims (pp, dp, tp), where dp holds dp x cp ranks (all that
share the parameters). Expert parallelism views the same mesh with dp unflattened into (dp_mod_ep, ep)
(backend/strategies/ep_mesh.py), context parallelism into (dp_mod_cp, cp) (backend/strategies/cp_layout.py). The
dimensions, their order and what folds into which come from backend/spec/dims.py."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from backend.runtime.timeouts import group_timeout_s
from backend.spec import Backend, Device, ExperimentSpec, dims

MESH_DIMS = dims.mesh_dims(dims.DIMS)
"""("pp", "dp", "tp")"""


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
                                                                scheduler_limit=str(spec.runtime.executor) == "slurm")),
                                **kwargs)
    return backend, device


def build_mesh(spec: ExperimentSpec, device: torch.device):  # -> DeviceMesh | None
    """(pp, dp x cp, tp) mesh laid out as ParallelSpec.coords (row-major, tp fastest); None for one rank."""
    p = spec.parallel
    if p.world_size == 1:
        return None
    return init_device_mesh(device.type, dims.mesh_shape(dims.DIMS, p.degrees()), mesh_dim_names=MESH_DIMS)
