"""The SLURM client commands ShardLab uses: sbatch, squeue, scontrol show job, scancel. No sacct: clusters
without accounting (and test clusters) cannot answer it; squeue plus `scontrol show job` (kept MinJobAge
seconds after the end) can. Every call is an argv list (no shell); SLURM_CONF comes from the environment."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

CALL_TIMEOUT_S = 30.0
FINAL_STATES = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE")


class SlurmError(RuntimeError):
    """A SLURM command failed; the message holds its stderr."""


@dataclass
class JobState:
    state: str
    """SLURM's JobState (PENDING, RUNNING, COMPLETED, ...), or VANISHED when neither squeue nor scontrol knows it."""
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""

    @property
    def finished(self) -> bool:
        return self.state in FINAL_STATES or self.state == "VANISHED"


def _run(argv: list[str], env: dict | None = None, timeout: float = CALL_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError as e:
        raise SlurmError(f"{argv[0]} not found: is this machine a SLURM client? ({e})") from e


def submit(script: Path, *, env: dict | None = None) -> str:
    """sbatch the script; returns the job id."""
    done = _run(["sbatch", "--parsable", str(script)], env=env)
    if done.returncode != 0:
        raise SlurmError(f"sbatch {script} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def query(job_id: str) -> JobState:
    """The job's state: squeue while it is queued or running, then scontrol show job, else VANISHED."""
    sq = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
    line = sq.stdout.strip().splitlines()[0] if sq.returncode == 0 and sq.stdout.strip() else ""
    if line:
        state, reason, nodes = (line.split("|") + ["", ""])[:3]
        if state not in FINAL_STATES:
            return JobState(state, "" if reason == "None" else reason, nodes)
    return show_job(job_id)


def show_job(job_id: str) -> JobState:
    sc = _run(["scontrol", "show", "job", "-o", job_id])
    if sc.returncode != 0 or "JobState=" not in sc.stdout:
        return JobState("VANISHED", (sc.stderr or sc.stdout).strip())
    fields = dict(kv.split("=", 1) for kv in sc.stdout.split() if "=" in kv)
    reason = fields.get("Reason", "")
    return JobState(fields.get("JobState", "UNKNOWN"), "" if reason == "None" else reason, fields.get("NodeList", ""),
                    fields.get("ExitCode", ""))


def cancel(job_id: str) -> None:
    done = _run(["scancel", job_id])
    if done.returncode != 0:
        raise SlurmError(f"scancel {job_id} failed: {done.stderr.strip()}")


def client_env(extra: dict | None = None) -> dict[str, str]:
    return {**os.environ, **{k: str(v) for k, v in (extra or {}).items()}}
