"""How the tests start programs, in one place: the torchrun command line, the CLI in-process, the CLI as a process.

- `torchrun(world, program, ...)`: `python -m torch.distributed.run --standalone --nproc-per-node W PROGRAM...` with
  the environment every rank needs (one OpenMP thread, the repository on PYTHONPATH, faulthandler on). Rank programs
  of the tests run through the farm (tests/helpers/farm.py), which uses this command line.
- `cli(*argv)`: `backend.cli.main(argv)` in this process, stdout, stderr and the exit code captured (an argparse
  usage error's SystemExit included): the CLI's contract without a Python start-up per call.
- `cli_process(*argv)`: `python -m backend ...` as a process, for what only a process shows: the entry point, signals,
  a worker's life, stray processes.
- `job_env()` / `assert_no_orphans(result, job_id)`: a launcher job tagged with its own id, and the check that none
  of its processes outlived it (the launcher's own tests launch through backend.launch.launcher as users do).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from backend.result import RunResult

ROOT = Path(__file__).resolve().parents[2]


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that imports the repository's packages."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"} | (extra or {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(world: int, program: Sequence[str]) -> list[str]:
    """The one torchrun command line: `program` is ["-m", "module", args...] or ["script.py", args...]."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *program]


def torchrun(world: int, program: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
             cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(world, program), cwd=cwd, env=rank_env(env), capture_output=True, text=True,
                          timeout=timeout_s)


@dataclass
class CliRun:
    """One CLI call: its exit code and what it printed."""

    code: int
    out: str
    err: str


@contextlib.contextmanager
def _environ(env: dict[str, str] | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cli(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> CliRun:
    """`python -m backend ARGV` in this process: backend.cli.main(argv), with env set and cwd entered for the call."""
    from backend.cli import main

    out, err = io.StringIO(), io.StringIO()
    with _environ(env), contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    return CliRun(code, out.getvalue(), err.getvalue())


def cli_process(*argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
                timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python -m backend ARGV` as a process (the entry point itself, or what needs a process of its own)."""
    return subprocess.run([sys.executable, "-m", "backend", *argv], cwd=cwd, env=rank_env(env), capture_output=True,
                          text=True, timeout=timeout_s)


def job_env(fault: str | None = None) -> tuple[dict[str, str], str]:
    """(extra_env, job id) for run_experiment: the job's processes carry the id; `fault`: SHARDLAB_FAULT."""
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    env = {"SHARDLAB_JOB_ID": job_id}
    if fault:
        env["SHARDLAB_FAULT"] = fault
    return env, job_id


def assert_no_orphans(result: RunResult, job_id: str) -> None:
    from backend.launch.procs import job_processes

    launch = result.env.get("launch", {})
    assert launch.get("job_id") == job_id
    left = job_processes(job_id, launch.get("pgid"))
    assert not left, f"orphans of {job_id}: {[(p.pid, p.cmdline()) for p in left]}"
