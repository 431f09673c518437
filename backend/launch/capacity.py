"""Can this host run a LOCAL job? The device it asks for (cuda where there is none: a warning, as a shared store's
worker may run elsewhere), ranks against cores, and the predicted host memory of all ranks
against the available RAM, checked before anything launches (the New-experiment page, `run`, `submit` and the worker
alike).
SLURM runs are bounded by the cluster config instead (backend/cluster/submit.cluster_problem).

Memory: a CPU rank holds its parameters, gradients, optimizer state and activations in host RAM: the analytic
estimate's fullest moment per rank (the activation peak, optimizer.step or the start of the loss's backward:
RankEstimate.moments, as the New-experiment fit check) plus the torch runtime of one rank process (RANK_RUNTIME_BYTES).
A GPU rank keeps its tensors on its device, so only its runtime counts here. The loss reference is not counted: it skips
itself when it would not fit (engine/reference.py). The sum must stay within the available RAM minus a headroom.

Ranks: more ranks than cores time-share the cores (a warning: step times stretch, the cpu profile models it);
beyond `ranks_per_core` x cores (at least MIN_RANK_LIMIT) the job is refused, because every rank is a process of
~0.3 GiB and a few seconds of start-up. Limits come from the environment (see `Limits.from_env`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil

from backend.analytic.units import GiB
from backend.spec import ExperimentSpec

RANK_RUNTIME_BYTES = 320 * 2**20
"""One rank process after importing the engine and joining a gloo group: 313 MiB RSS (226 MiB unique), measured
with psutil on torch 2.13.0+cpu."""
MIN_RANK_LIMIT = 8
"""World 8 runs on a 2-core host (~2.3 s/step DDP, ~4 s/step 3D for a 3.7M-parameter model: MACHINE_FACTS.md)."""
HINT = ('Shrink it with "Run it here" (`--run-here`: the same model family, scaled down for CPU ranks), or measure '
        'the full size without allocating it with "Trace at full size" (`python -m backend trace`).')

DEVICE_HINT = ('"Run it here" (`--run-here`) runs the same model family on this host\'s CPU ranks; a spec from a GPU '
               "run or a Plan layout keeps its device=cuda otherwise.")


@dataclass(frozen=True)
class Host:
    cores: int
    available_bytes: int

    @classmethod
    def this(cls) -> Host:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls(cores=cores, available_bytes=int(psutil.virtual_memory().available))


@dataclass(frozen=True)
class Limits:
    headroom: float = 0.2
    """Share of the available RAM left free (page cache, the dashboard, the worker, other users)."""
    ranks_per_core: int = 4
    max_ranks: int | None = None
    """Absolute limit on local ranks; None: max(MIN_RANK_LIMIT, ranks_per_core x cores)."""

    @classmethod
    def from_env(cls) -> Limits:
        """SHARDLAB_HOST_MEM_HEADROOM (0..0.9), SHARDLAB_MAX_RANKS_PER_CORE, SHARDLAB_MAX_LOCAL_RANKS."""
        env = os.environ
        max_ranks = env.get("SHARDLAB_MAX_LOCAL_RANKS")
        return cls(headroom=min(0.9, max(0.0, float(env.get("SHARDLAB_HOST_MEM_HEADROOM", cls.headroom)))),
                   ranks_per_core=max(1, int(env.get("SHARDLAB_MAX_RANKS_PER_CORE", cls.ranks_per_core))),
                   max_ranks=int(max_ranks) if max_ranks else None)

    def rank_limit(self, host: Host) -> int:
        return self.max_ranks if self.max_ranks is not None else max(MIN_RANK_LIMIT, self.ranks_per_core * host.cores)


@dataclass
class Capacity:
    """The verdict for one spec on one host: refused when `problems` is not empty."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    need_bytes: float | None = None
    """Predicted host memory of all ranks of this host (None when not computed: SLURM, or too many ranks)."""
    usable_bytes: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def refusal(self) -> str:
        return "; ".join(self.problems)


def gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def check(spec: ExperimentSpec, host: Host | None = None, limits: Limits | None = None) -> Capacity:
    """Ranks vs cores and host memory for a local spec (SLURM specs pass: the cluster config bounds them)."""
    if str(spec.runtime.executor) != "local":
        return Capacity()
    host, limits = host or Host.this(), limits or Limits.from_env()
    ranks = spec.parallel.world_size // spec.runtime.nnodes  # this host's share (torchrun --nproc-per-node)
    out = Capacity(usable_bytes=host.available_bytes * (1 - limits.headroom))
    if (device := device_warning(spec)) is not None:
        out.warnings.append(device)
    limit = limits.rank_limit(host)
    if ranks > limit:
        how = ("SHARDLAB_MAX_LOCAL_RANKS" if limits.max_ranks is not None
               else f"{host.cores} cores x {limits.ranks_per_core} ranks per core (at least {MIN_RANK_LIMIT})")
        out.problems.append(f"{ranks:,} local ranks > {limit} this host can run ({how}; set SHARDLAB_MAX_LOCAL_RANKS "
                            "to change it, or submit to SLURM)")
        return out  # the memory estimate grows with the world size: not computed for a refused world
    if ranks > host.cores:
        out.warnings.append(f"{ranks} ranks on {host.cores} cores: ranks time-share the cores, so the measured step "
                            "time is longer than on one core per rank (the cpu step-time profile accounts for it)")
    per_rank, state = rank_host_bytes(spec)
    processes = 1 if str(spec.framework) == "jax" else ranks  # JAX: one process with `ranks` virtual devices
    out.need_bytes = sum(per_rank) + processes * RANK_RUNTIME_BYTES
    if out.need_bytes > out.usable_bytes:
        worst = max(per_rank, default=0.0)
        out.problems.append(
            f"this host cannot hold the run: {ranks} ranks need {gib(out.need_bytes)} of RAM ({state} up to "
            f"{gib(worst)} per rank by the analytic estimate + {gib(RANK_RUNTIME_BYTES)} runtime per process) > "
            f"{gib(out.usable_bytes)} usable ({gib(host.available_bytes)} available - {limits.headroom:.0%} headroom). "
            + HINT)
    return out


def device_warning(spec: ExperimentSpec) -> str | None:
    """A spec that asks for CUDA (device=cuda or backend=nccl: a GPU run's or a Plan layout's) on a host without it:
    the launcher's preflight fails it. A warning, not a refusal: a shared store's worker may run on a GPU host."""
    r = spec.runtime
    if str(r.device) != "cuda" and str(r.backend) != "nccl":
        return None
    from backend.engine import cuda_available

    if cuda_available():
        return None
    return (f"device={r.device} backend={r.backend} needs CUDA, and this host has none: a run launched here (or by a "
            f"worker on this host) fails. {DEVICE_HINT}")


def rank_host_bytes(spec: ExperimentSpec) -> tuple[list[float], str]:
    """(host bytes each rank of this host holds beyond its runtime, what they are) from the analytic estimate."""
    from backend.analytic.estimate import estimate
    from backend.engine.device_facts import host_device

    device = host_device(str(spec.runtime.device))
    if str(device) != "cpu":
        return [], "tensors on the GPU"
    est = estimate(spec, device="cpu")
    fullest = [r.fullest_bytes() for r in est.per_rank]
    ranks = spec.parallel.world_size // spec.runtime.nnodes
    node = spec.runtime.node_rank
    return [float(b) for b in fullest[node * ranks:(node + 1) * ranks]], "model state and activations"
