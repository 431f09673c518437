"""Cluster settings, read by the dashboard, the CLI and the worker: `$SHARDLAB_CLUSTER_CONFIG`, else
`<repo>/shardlab.toml`, section `[slurm]`:

    [slurm]
    partition = "gpu"            # sbatch --partition (omit: the cluster's default)
    account = "ml-infra"         # sbatch --account (omit: none)
    gpus_per_node = 8            # ranks per node on GPU clusters (--gpus-per-node); 0 = CPU cluster
    time_limit = "02:00:00"      # sbatch --time; omit: the spec's runtime.timeout_s, rounded up to seconds
    run_dir = "/shared/shardlab/runs"   # on a filesystem every node mounts; a relative one: this file's folder
    extra_sbatch = ["#SBATCH --exclusive", "#SBATCH --constraint=h100"]
    python = "/shared/venvs/shardlab/bin/python"   # interpreter on the nodes (default: this one)

Every value is checked here, before it can reach a script: names are [A-Za-z0-9_.,-] (not starting with '-'), extra
lines are single `#SBATCH --option[=value]` lines.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

REPO = Path(__file__).resolve().parents[2]
ENV = "SHARDLAB_CLUSTER_CONFIG"
DEFAULT_PATH = REPO / "shardlab.toml"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,-]{0,127}")
_TIME = re.compile(r"\d{1,5}(:\d{1,2}){0,2}|\d{1,3}-\d{1,2}(:\d{1,2}){0,2}")
_SBATCH_LINE = re.compile(r"#SBATCH --[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:/@%+][A-Za-z0-9_.,:=/@%+-]*)?")


class ClusterConfigError(ValueError):
    """A cluster config that cannot be used, with the reason."""


class SlurmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    """sbatch --partition; None: the cluster's default partition."""
    account: str | None = None
    """sbatch --account; None: none given."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """GPUs per node (ranks per node on a GPU cluster); 0 for CPU clusters, where the spec's ranks per node apply."""
    time_limit: str | None = None
    """sbatch --time (minutes, MM:SS, HH:MM:SS or D-HH:MM:SS); None: the spec's runtime.timeout_s."""
    run_dir: Path = REPO / "data" / "runs"
    """Folder on a filesystem all nodes mount: one sub-folder per run holds job.sbatch, spec.json, log and result."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH --option[=value]` lines, one option per line."""
    python: str = sys.executable
    """The Python interpreter (with torch) on the compute nodes."""
    repo: Path = REPO
    """This code on the compute nodes (the rank entry point runs from here)."""

    @field_validator("partition", "account")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a SLURM name (letters, digits, '_', '.', ',', '-')")
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _TIME.fullmatch(v):
            raise ValueError(f"time_limit {v!r} is not a SLURM time (minutes, MM:SS, HH:MM:SS, D-HH:MM:SS)")
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _lines(cls, v: list[str]) -> list[str]:
        bad = [line for line in v if not _SBATCH_LINE.fullmatch(line)]
        if bad:
            raise ValueError(f"extra_sbatch lines must each be one '#SBATCH --option[=value]' line: {bad!r}")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if "\n" in v or not v.strip():
            raise ValueError(f"python {v!r} is not an interpreter path")
        return v

    def ranks_per_node(self, world_size: int, nnodes: int) -> int:
        return self.gpus_per_node or world_size // nnodes

    def check_spec(self, world_size: int, nnodes: int) -> str | None:
        """The problem with running world_size ranks on nnodes nodes of this cluster, with the arithmetic."""
        if world_size % nnodes:
            return f"world_size={world_size} is not divisible by nodes={nnodes}"
        if self.gpus_per_node and world_size != nnodes * self.gpus_per_node:
            return (f"world_size={world_size} != nodes {nnodes} x gpus_per_node {self.gpus_per_node} = "
                    f"{nnodes * self.gpus_per_node}: a GPU cluster runs one rank per GPU")
        return None


def config_path() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_PATH)


def load(path: Path | None = None) -> SlurmConfig:
    """The [slurm] settings (defaults when the file does not exist: a CPU cluster, runs under data/runs)."""
    path = path or config_path()
    if not path.exists():
        if os.environ.get(ENV):
            raise ClusterConfigError(f"{ENV}={path} does not exist")
        return SlurmConfig()
    try:
        data = tomllib.loads(path.read_text()).get("slurm", {})
        cfg = SlurmConfig.model_validate(data)
    except ValidationError as e:
        raise ClusterConfigError(f"{path}: " + "; ".join(_problem(err) for err in e.errors())) from e
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ClusterConfigError(f"{path}: {e}") from e
    # a relative folder is the config file's, not whichever folder a worker or the dashboard was started from: a
    # worker restarted elsewhere must find its jobs' folders (slurm.json) again, not submit them anew
    here = path.resolve().parent
    return cfg.model_copy(update={"run_dir": here / cfg.run_dir, "repo": here / cfg.repo})


def _problem(err: dict) -> str:
    """One pydantic error as '[slurm] key: message (got value)'."""
    key = ".".join(str(x) for x in err.get("loc", ())) or "[slurm]"
    return f"[slurm] {key}: {str(err.get('msg', 'invalid')).removeprefix('Value error, ')} (got {err.get('input')!r})"
