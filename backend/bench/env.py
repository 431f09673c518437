"""Where a run happened: versions, backend, device, cores, host."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def rank_env(backend: str, device: torch.device) -> dict[str, Any]:
    """This rank's view of its environment (gathered from every rank, merged by `merge`)."""
    import torch  # here: `merge` runs where the result is assembled (a worker or the CLI), which need not load torch
    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": backend,
        "device_type": device.type,
        "cpu_cores": os.cpu_count(),
        "cpu_threads_per_rank": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["gpu_count"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
    else:
        out["device_name"] = cpu_name()
        out["gpu_count"] = 0
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or sys.platform


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One env dict for the run: rank 0's fields, plus every distinct hostname and device."""
    if not per_rank:
        return {}
    out = dict(per_rank[0])
    out.pop("hostname", None)
    out["hostnames"] = sorted({e.get("hostname", "?") for e in per_rank})
    out["device_names"] = sorted({str(e.get("device_name", "?")) for e in per_rank})
    out["world_size"] = len(per_rank)
    return out
