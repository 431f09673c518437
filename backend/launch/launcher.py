"""Run one experiment as real processes under torch's own launcher and return its `RunResult`.

`run_experiment` writes `workdir/spec.json`, starts `python -m torch.distributed.run ... -m
backend.engine.rank --spec ... --out workdir` in its own session, streams its output (progress lines to
`on_progress`, everything to `workdir/log.txt`), and ends the whole process tree on the first failing
rank, on `spec.runtime.timeout_s`, or on `cancel`. It always returns a result and writes it atomically
to `workdir/result.json`: ok (assembled from `ranks.json`), or failed/oom/timeout/cancelled with the
first failing rank, its traceback, the log tail and the predicted memory per rank. A disk that cannot take
result.json costs the file, never the finished run (the caller stores the returned result). What the ranks write
and print is read through backend/runtime/protocol.py.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from backend.atomic_io import write_atomic
from backend.engine import cuda_available  # without torch for a CPU-only build: launching a CPU run loads no torch
from backend.launch import nccl, outcome, torchrun
from backend.launch.outcome import Failure
from backend.launch.procs import Job
from backend.result import RankResult, RunResult, Status
from backend.runtime.protocol import (
    RANKS_FILE,
    ProtocolError,
    any_rank_error,
    clear_rank_outputs,
    progress_reader,
    ranks_path,
    read_ranks,
)
from backend.spec import Device, ExperimentSpec

log = logging.getLogger("shardlab.launch")
POLL_S = 0.2
GRACE_S = 5.0
"""SIGTERM -> SIGKILL grace when the launcher ends a job."""
PEER_EXIT_S = 20.0
"""How long torchrun gets to end the job by itself after a rank reported an error."""

Assembler = Callable[[ExperimentSpec, dict], RunResult]


def run_experiment(
    spec: ExperimentSpec,
    *,
    workdir: Path,
    on_progress: Callable[[dict], None] | None = None,
    cancel: threading.Event | None = None,
    extra_env: dict | None = None,
    rank_module: str = torchrun.RANK_MODULE,
    assemble: Assembler | None = None,
) -> RunResult:
    """Run `spec` to completion (or failure) and return its result; never raises for a failed run.

    on_progress is called on the log-reader thread with each `SHARDLAB_PROGRESS` dict.
    rank_module / assemble replace the engine (tests use a small fixture program).
    """
    workdir = Path(workdir).resolve()  # the ranks run with cwd = repo root
    workdir.mkdir(parents=True, exist_ok=True)
    started_at, t0 = _now(), time.monotonic()
    clear_outputs(workdir)
    spec_path = workdir / "spec.json"
    write_atomic(spec_path, spec.to_json())
    env, job_id = torchrun.build_env(extra_env)
    cuda = _auto_needs_cuda_check(spec) and cuda_available()
    env = nccl.job_env(spec, workdir, env, cuda_available=cuda)
    if rank_module == torchrun.RANK_MODULE:  # issue 14: DeepSpeed / JAX runs have their own entry module
        rank_module = torchrun.rank_module_for(spec)
    cmd = torchrun.build_command(spec, spec_path, workdir, rank_module)
    launch = {"job_id": job_id, "command": cmd, "node_rank": spec.runtime.node_rank,
              "nproc_per_node": torchrun.nproc_per_node(spec), "nccl": nccl.uses_nccl(spec, cuda_available=cuda)}

    problem = preflight(spec)
    if problem:
        result = failed_result(spec, Failure(Status.FAILED, problem), launch)
    else:
        result = _run_job(spec, workdir, cmd, env, job_id, launch, on_progress, cancel, assemble, t0, rank_module)
    result.started_at, result.finished_at = started_at, _now()
    result.wall_s = time.monotonic() - t0
    keep_result(workdir, result)
    return result


def keep_result(workdir: Path, result: RunResult) -> None:
    """Write result.json; a disk that cannot take it (full, read-only) must not cost the finished run: the result is
    returned all the same and the caller stores it from memory (the worker retries the file too)."""
    try:
        write_atomic(workdir / "result.json", result.to_json())
    except OSError as e:
        log.warning("%s/result.json not written (%s): the %s result is kept in memory for the caller to store",
                    workdir, e, result.status)


def _run_job(spec, workdir, cmd, env, job_id, launch, on_progress, cancel, assemble, t0, rank_module) -> RunResult:
    if cancel is not None and cancel.is_set():
        return failed_result(spec, Failure(Status.CANCELLED, "cancelled before launch"), launch)
    on_line = progress_reader(on_progress) if on_progress else None
    try:
        job = Job(cmd, env=env, cwd=torchrun.ROOT, job_id=job_id, log_path=workdir / "log.txt", on_line=on_line)
    except OSError as e:
        return failed_result(spec, Failure(Status.FAILED, f"could not start torchrun: {e}"), launch)
    launch["pgid"] = job.pgid
    try:
        ended = _supervise(job, spec, workdir, cancel, t0, marker=rank_module)
    finally:
        job.close()
    wall_s = time.monotonic() - t0
    if ended == "cancelled":
        return failed_result(spec, Failure(Status.CANCELLED, f"cancelled after {wall_s:.1f} s"), launch, job.tail())
    if ended == "timeout":
        failure = outcome.timed_out(workdir, spec.runtime.timeout_s, wall_s,
                                    nccl=bool(launch.get("nccl")))
        return failed_result(spec, failure, launch, job.tail())
    rc = job.proc.returncode
    if rc == 0 and ranks_path(workdir).exists():
        return assembled_result(spec, workdir, assemble, launch, job.tail())
    if rc == 0 and spec.runtime.nnodes > 1:
        return _other_node_result(spec, launch)
    if rc == 0:
        failure = Failure(Status.FAILED, f"job exited 0 but wrote no {RANKS_FILE}")
        return failed_result(spec, failure, launch, job.tail())
    return failed_result(spec, outcome.classify_exit(workdir, rc, job.tail()), launch, job.tail())


def _supervise(job: Job, spec: ExperimentSpec, workdir: Path, cancel: threading.Event | None, t0: float,
               marker: str) -> str:
    """Wait for the job; end it on cancel, timeout, or a rank error torchrun does not act on. -> why it ended."""
    deadline = t0 + spec.runtime.timeout_s
    first_error_at: float | None = None
    while job.poll() is None:
        now = time.monotonic()
        if cancel is not None and cancel.is_set():
            job.terminate(GRACE_S)
            return "cancelled"
        if now >= deadline:
            job.dump_stacks(marker)  # where each rank is stuck, for the result's error
            job.terminate(GRACE_S)
            return "timeout"
        if first_error_at is None and any_rank_error(workdir):
            first_error_at = now
        if first_error_at is not None and now - first_error_at > PEER_EXIT_S:
            job.terminate(GRACE_S)
            return "failed"
        time.sleep(POLL_S)
    return "exited"


def assembled_result(spec: ExperimentSpec, workdir: Path, assemble: Assembler | None, launch: dict,
                     tail: str) -> RunResult:
    """The run's result from workdir/ranks.json (`assemble`, default: the spec's framework's assembler), or a
    failed result saying why the payload could not be read or assembled."""
    try:
        payload = read_ranks(workdir).to_dict()
    except ProtocolError as e:
        return failed_result(spec, Failure(Status.FAILED, f"the ranks' payload is unreadable: {e}"), launch, tail)
    try:
        if assemble is None:
            from backend.frameworks.assemblers import assembler_for

            assemble = assembler_for(spec)
        result = assemble(spec, payload)
    except Exception as e:  # a broken payload is a failed run, with the reason
        import traceback

        failure = Failure(Status.FAILED, f"assembling the result failed: {type(e).__name__}: {e}",
                          traceback=traceback.format_exc())
        return failed_result(spec, failure, launch, tail)
    result.env = {**result.env, "launch": launch}
    result.step_time_predicted_s = predicted_step_s(spec, result)
    return result


def predicted_step_s(spec: ExperimentSpec, result: RunResult) -> float | None:
    """The step-time model on the 'cpu' profile for a run whose ranks ran on the CPU (None otherwise, or without a
    profile: backend/bench/cpu_profile.py); never fails the run. A spec the model does not time on CPU ranks (fp8)
    gets None and a note saying so."""
    if "cpu" not in str(result.env.get("device", "cpu")).lower():
        return None
    from backend.analytic.steptime.untimed import untimed_reason

    if (why := untimed_reason(spec, "cpu")) is not None:
        result.notes.append(f"No step-time prediction: {why}.")
        return None
    try:
        from backend.analytic.steptime.hardware import CPU, load_profiles
        from backend.analytic.steptime.model import step_time

        profiles = load_profiles()
        return step_time(spec, profiles[CPU]).summary["step_s"] if CPU in profiles else None
    except Exception:  # noqa: BLE001 - a gap in the step-time model leaves the field empty
        return None


def _other_node_result(spec: ExperimentSpec, launch: dict) -> RunResult:
    """A node of a multi-node job that did not host global rank 0: its part succeeded, it holds no payload."""
    launch["holds_measurements"] = False
    note = (f"node_rank {spec.runtime.node_rank} of {spec.runtime.nnodes}: its ranks finished cleanly; "
            f"global rank 0 ran on another node, whose launcher wrote {RANKS_FILE} and holds the measurements")
    return RunResult(status=Status.OK, spec=spec, env=_base_env(launch), notes=[note])


def failed_result(spec: ExperimentSpec, failure: Failure, launch: dict, log_tail: str | None = None) -> RunResult:
    return RunResult.of_spec(
        spec, status=failure.status, error=failure.error, failing_rank=failure.failing_rank,
        traceback=failure.traceback, log_tail=log_tail, env=_base_env(launch), per_rank=predicted_ranks(spec),
    )


def predicted_ranks(spec: ExperimentSpec) -> list[RankResult]:
    """Analytic memory per rank (nothing measured), as an ok run of the spec stores it (engine/assemble.py: the
    eager twin's estimate, peak = the fullest moment); [] when the estimator fails for this spec."""
    try:
        from backend.analytic.estimate import estimate
        from backend.engine import host_device
        from backend.engine.assemble import predicted_memory
        from backend.strategies.compiled import eager_twin

        rows = estimate(eager_twin(spec), device=host_device(str(spec.runtime.device))).per_rank
        return [RankResult(rank=row.rank, predicted=predicted_memory(row), coords=spec.parallel.coords(row.rank),
                           comm_predicted=dict(row.comm_bytes)) for row in rows]
    except Exception:  # the estimator may not cover every spec; a failed run still gets stored
        return []


def preflight(spec: ExperimentSpec) -> str | None:
    """What only the launcher can know before spawning: is the requested device there, and enough of it."""
    r = spec.runtime
    wants_cuda = r.device == Device.CUDA or r.backend == "nccl"
    if r.device == Device.CPU and not wants_cuda:
        return None
    if r.device == Device.CPU and r.backend == "nccl":
        return "backend=nccl needs device=cuda (got device=cpu)"
    available = cuda_available()
    if not wants_cuda and not available:
        return None
    import torch

    if wants_cuda and not available:
        return (f"device={r.device} backend={r.backend} needs CUDA, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if available:
        per_node, gpus = torchrun.nproc_per_node(spec), torch.cuda.device_count()
        if per_node > gpus:
            return (f"world_size({spec.parallel.world_size}) / nnodes({r.nnodes}) = {per_node} ranks per node "
                    f"> {gpus} visible CUDA device(s): CUDA runs one rank per GPU")
    return None


def _auto_needs_cuda_check(spec: ExperimentSpec) -> bool:
    return str(spec.runtime.backend) == "auto" and spec.runtime.device == Device.AUTO


def _base_env(launch: dict) -> dict:
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"python": platform.python_version(), "torch": torch_version, "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(), "launch": launch}


def clear_outputs(workdir: Path) -> None:
    """A reused workdir must not let a previous run's files speak for this one."""
    clear_rank_outputs(workdir)
    (Path(workdir) / "result.json").unlink(missing_ok=True)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
