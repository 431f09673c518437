"""Checks a SLURM submission needs beyond the spec's own (the dashboard and the CLI both call it)."""

from __future__ import annotations

from backend.cluster.slurm_config import ClusterConfigError, config_path, load
from backend.spec import ExperimentSpec


def cluster_problem(spec: ExperimentSpec) -> str | None:
    """Why this spec cannot go to the configured cluster (None when it can), with the arithmetic."""
    try:
        cfg = load()
    except ClusterConfigError as e:
        return f"cluster config: {e}"
    if str(spec.framework) == "jax":  # one process of N virtual CPU devices (frameworks/jax/run.py), no torchrun
        return ("framework jax runs in one process on this host's virtual CPU devices, not as ranks on SLURM nodes: "
                "run it here (executor local)")
    problem = cfg.check_spec(spec.parallel.world_size, spec.runtime.nnodes)
    return f"{problem} (cluster config {config_path()})" if problem else None
