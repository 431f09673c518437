"""The `torch.distributed.run` command line and environment for one experiment.

Standalone jobs use torchrun's own local rendezvous; multi-node jobs join a c10d rendezvous whose id
is derived from the spec, so every node's launcher computes the same id without talking to the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

from backend.spec import ExperimentSpec

ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = "backend.engine.rank"
JOB_ENV = "SHARDLAB_JOB_ID"
"""Every process of a job inherits this tag, so survivors can be found even after they leave its session."""


def nproc_per_node(spec: ExperimentSpec) -> int:
    return spec.parallel.world_size // spec.runtime.nnodes


def rdzv_id(spec: ExperimentSpec) -> str:
    """Identical on every node of one job: the spec minus the per-node field."""
    shared = spec.model_dump(mode="json")
    shared["runtime"].pop("node_rank", None)
    digest = hashlib.sha1(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
    return f"shardlab-{digest}"


FRAMEWORK_MODULES = {"deepspeed": "backend.frameworks.deepspeed.rank", "jax": "backend.frameworks.jax.run"}
"""Issue 14: the entry module of each non-torch framework (same --spec/--out contract and output files)."""


def rank_module_for(spec: ExperimentSpec) -> str:
    return FRAMEWORK_MODULES.get(str(spec.framework), RANK_MODULE)


def build_command(spec: ExperimentSpec, spec_path: Path, out_dir: Path, module: str = RANK_MODULE) -> list[str]:
    if str(spec.framework) == "jax" and module == FRAMEWORK_MODULES["jax"]:  # one process, N virtual devices
        return [sys.executable, "-m", module, "--spec", str(spec_path), "--out", str(out_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    r = spec.runtime
    if r.nnodes > 1:
        cmd += [
            "--nnodes", str(r.nnodes),
            "--node-rank", str(r.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", str(r.rdzv_endpoint),
            "--rdzv-id", rdzv_id(spec),
        ]
    else:
        cmd += ["--standalone"]
    cmd += ["--nproc-per-node", str(nproc_per_node(spec)), "--max-restarts", "0"]
    cmd += ["-m", module, "--spec", str(spec_path), "--out", str(out_dir)]
    return cmd


def build_env(extra_env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """(environment for torchrun, job id). extra_env wins, including a caller-chosen SHARDLAB_JOB_ID."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a native crash in a rank (SIGSEGV, SIGABRT) leaves its Python stacks in the log
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env[JOB_ENV] = f"job-{uuid.uuid4().hex[:12]}"
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    return env, env[JOB_ENV]
