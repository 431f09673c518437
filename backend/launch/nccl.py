"""NCCL-specific launch settings: the flight recorder and collective timing.

A hung NCCL collective does not block the host thread (the host blocks later, in a synchronize or the
next barrier), so a Python stack dump names the wrong place. NCCL's watchdog sees the hang once the
process group's timeout passes and, with the flight recorder on, dumps every rank's last collectives
(sequence numbers, sizes, states) to files: the culprit is the first collective some rank never entered.
That only works when the group timeout fires before the launcher ends the job, hence the ranks'
`backend.runtime.timeouts.group_timeout_s`.
Variables as torchtitan sets them (torchtitan/distributed/utils.py `init_distributed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TRACE_BUFFER_ENTRIES = 20000  # torchtitan's default comm.trace_buf_size
TRACE_FILE_PREFIX = "nccl_trace_rank_"


def uses_nccl(spec: Any, *, cuda_available: bool) -> bool:
    """Whether the job's process group will be NCCL (backend.engine.mesh.pick_backend_device's rule)."""
    r = spec.runtime
    if str(r.backend) != "auto":
        return str(r.backend) == "nccl"
    device = str(r.device)
    return device == "cuda" or (device == "auto" and cuda_available)


def nccl_env(workdir: Path) -> dict[str, str]:
    """Environment for an NCCL job: flight recorder on and dumped on a watchdog timeout into the run's workdir
    (kept with its log), and CUDA-event timing of every collective (read by backend/bench/comm.py)."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(workdir) / TRACE_FILE_PREFIX),
        "TORCH_NCCL_ENABLE_TIMING": "1",
    }


def job_env(spec: Any, workdir: Path, base: dict[str, str], *, cuda_available: bool) -> dict[str, str]:
    """`base` plus the NCCL settings for an NCCL job; a variable already in `base` (the user's or the
    caller's) is kept as given."""
    if not uses_nccl(spec, cuda_available=cuda_available):
        return dict(base)
    return {**nccl_env(workdir), **base}
