"""The batch script of one SLURM run (stored as <run dir>/job.sbatch, so it can be resubmitted by hand).

`sbatch job.sbatch` asks for N nodes, one task per node; the batch step takes the rendezvous address from
the allocation (`scontrol show node <first node>` -> NodeAddr, never a host name: one that does not resolve
makes torchrun hang) and `srun`s this same file with `--node ADDR:PORT` on every node, which execs one
torchrun per node: c10d rendezvous, R ranks per node, `--local-addr` = that node's NodeAddr, and the same
rank entry point and result protocol as a local run (`python -m backend.engine.rank --spec S --out DIR`, or
the spec's framework's: DeepSpeed's `backend.frameworks.deepspeed.rank`).

Nothing a user typed (names, tags, free text) is in the script; every path and value is shell-quoted and
the config's values were checked (backend.cluster.slurm_config).
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from backend.cluster.slurm_config import SlurmConfig
from backend.launch.torchrun import rank_module_for
from backend.spec import ExperimentSpec

SCRIPT_NAME = "job.sbatch"
OUTPUT_PATTERN = "slurm-%j.out"
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@%-]+")


def time_limit(spec: ExperimentSpec, cfg: SlurmConfig) -> str:
    """sbatch --time: the config's, else the spec's timeout as MM:SS (SLURM's minutes:seconds form)."""
    if cfg.time_limit:
        return cfg.time_limit
    total_s = max(1, math.ceil(spec.runtime.timeout_s))
    return f"{total_s // 60}:{total_s % 60:02d}"


def output_path(workdir: Path, job_id: str) -> Path:
    return workdir / OUTPUT_PATTERN.replace("%j", job_id)


def build_script(spec: ExperimentSpec, cfg: SlurmConfig, *, experiment_id: int, workdir: Path) -> str:
    nodes = spec.runtime.nnodes
    per_node = cfg.ranks_per_node(spec.parallel.world_size, nodes)
    if not _SAFE_PATH.fullmatch(str(workdir)):
        raise ValueError(f"run folder {str(workdir)!r} has characters an #SBATCH --output line cannot hold; "
                         "choose a run_dir of letters, digits and _ . / + @ % -")
    sbatch = [f"--job-name=shardlab-{int(experiment_id)}", f"--nodes={nodes}", "--ntasks-per-node=1",
              f"--time={time_limit(spec, cfg)}", f"--output={workdir}/{OUTPUT_PATTERN}", "--no-requeue"]
    if cfg.partition:
        sbatch.append(f"--partition={cfg.partition}")
    if cfg.account:
        sbatch.append(f"--account={cfg.account}")
    if cfg.gpus_per_node:
        sbatch.append(f"--gpus-per-node={cfg.gpus_per_node}")
    else:
        sbatch.append(f"--cpus-per-task={per_node}")
    q = shlex.quote
    torchrun = [q(cfg.python), "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
                "--rdzv-backend", "c10d", '--rdzv-endpoint "$2"', '--rdzv-id '
                                                                  f'"shardlab-{int(experiment_id)}-$SLURM_JOB_ID"',
                '--local-addr "$(node_addr "$SLURMD_NODENAME")"', "--max-restarts", "0",
                "-m", rank_module_for(spec), '--spec "$RUN_DIR/spec.json"', '--out "$RUN_DIR"']  # DeepSpeed's own
    lines = [
        "#!/bin/bash",
        f"# ShardLab experiment {int(experiment_id)}: world {spec.parallel.world_size} = {nodes} node(s) x {per_node} "
        "rank(s).",
        f"# Resubmit by hand: SLURM_CONF=... sbatch {q(str(workdir / SCRIPT_NAME))}",
        *[f"#SBATCH {opt}" for opt in sbatch],
        *cfg.extra_sbatch,
        "set -uo pipefail",
        f"RUN_DIR={q(str(workdir))}",
        f"cd {q(str(cfg.repo))}",
        f'export PYTHONPATH={q(str(cfg.repo))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        "export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1",
        "node_addr() { scontrol show node \"$1\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1; }",
        'if [ "${1:-}" = "--node" ]; then',
        "  # started by srun below, once per node",
        "  exec " + " ".join(torchrun),
        "fi",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'HEAD_ADDR=$(node_addr "$HEAD_NODE")',
        "PORT=$((20000 + SLURM_JOB_ID % 20000))",
        'echo "SHARDLAB_SLURM job $SLURM_JOB_ID nodes $SLURM_JOB_NODELIST rendezvous $HEAD_ADDR:$PORT"',
        f'srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$RUN_DIR/{SCRIPT_NAME}" --node '
        '"$HEAD_ADDR:$PORT"',
    ]
    return "\n".join(lines) + "\n"
