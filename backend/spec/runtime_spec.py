"""The runtime section of a spec: process-group backend, device, nodes, rendezvous, time limit and executor."""

from __future__ import annotations

from pydantic import Field

from backend.spec.choices import Backend, Device, Executor
from backend.spec.section_base import SpecSection


class RuntimeSpec(SpecSection):
    backend: Backend = Backend.AUTO
    """Process-group backend: auto picks nccl when CUDA is present, else gloo."""
    device: Device = Device.AUTO
    """Device: auto picks cuda (one rank per GPU) when present, else cpu."""
    nnodes: int = Field(1, ge=1, le=100_000)
    """Machines in the job (torchrun --nnodes)."""
    node_rank: int = Field(0, ge=0, le=100_000)
    """This machine's index (torchrun --node-rank)."""
    rdzv_endpoint: str | None = Field(None, max_length=255)
    """host:port of the c10d rendezvous for multi-node jobs; None runs standalone."""
    timeout_s: float = Field(600.0, gt=0, le=7 * 24 * 3600)
    """Wall-clock limit for the whole job; also bounds hung collectives."""
    executor: Executor = Executor.LOCAL
    """Where the worker runs it: local (torchrun on the worker's machine) or slurm (sbatch on the cluster of
    shardlab.toml [slurm]; nnodes nodes, rendezvous at the allocation's first node)."""
