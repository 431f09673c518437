"""The process-group timeout a rank sets, derived from the launcher's job timeout so that the two fire in the
right order: an NCCL collective that hangs trips NCCL's watchdog (and its flight-recorder dump,
backend/launch/nccl.py) before the launcher ends the job. Variables as torchtitan sets them
(torchtitan/distributed/utils.py `init_distributed`)."""

from __future__ import annotations

MAX_GROUP_TIMEOUT_S = 300.0  # torchtitan's comm.init_timeout_seconds
SCHEDULER_MARGIN_S = 120.0
"""gloo under a scheduler: how long past the job's limit the process group waits, so that the scheduler's own time
limit (SLURM polls it and then sends its signals, seconds to a minute late) is what ends an over-time job."""


def group_timeout_s(job_timeout_s: float, backend: str, *, scheduler_limit: bool = False) -> float:
    """Process-group timeout: on nccl half the job's limit, at most MAX_GROUP_TIMEOUT_S, so a collective that
    hangs in the first half of the job trips the watchdog (and its flight-recorder dump) before the launcher
    kills the job; gloo keeps the job's limit (its hangs block the host, where the launcher's stack dump
    sees them)."""
    if backend != "nccl":
        return float(job_timeout_s) + (SCHEDULER_MARGIN_S if scheduler_limit else 0.0)
    return max(1.0, min(job_timeout_s / 2, MAX_GROUP_TIMEOUT_S))
