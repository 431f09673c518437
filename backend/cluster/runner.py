"""The worker's runner for `runtime.executor = "slurm"`: same signature and result as
`backend.launch.launcher.run_experiment`, but the job runs on the cluster.

It writes spec.json and job.sbatch into the run's folder under the config's shared run_dir, submits with
sbatch (or, after a worker restart, re-attaches to the job recorded in slurm.json), then polls:
PENDING (with SLURM's reason) and RUNNING (progress lines from the job's output file) go to on_progress;
cancel -> scancel. When the job leaves the queue its result is collected exactly like a local run's:
ranks.json assembled by the engine's assembler, or a failed result with SLURM's state and reason, the
first failing rank's traceback (rank-*.error.json) and the output's tail. A job that vanished (no state
anywhere) and left no result is failed with that reason.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from backend import run_folders
from backend.atomic_io import write_atomic
from backend.cluster import slurm
from backend.cluster.reattach import Detached
from backend.cluster.script import SCRIPT_NAME, build_script, output_path
from backend.cluster.slurm_config import SlurmConfig, load
from backend.launch import outcome
from backend.launch.launcher import assembled_result, clear_outputs, failed_result, keep_result
from backend.launch.outcome import Failure
from backend.result import RunResult, Status
from backend.runtime.protocol import any_rank_error, progress_reader, ranks_path
from backend.spec import ExperimentSpec

WORKER_ENV = "SHARDLAB_WORKER_ID"  # backend.worker.recovery.WORKER_ENV (not imported: the worker imports this module)
POLL_S = 1.0
TAIL_CHARS = 6000
PHASE_CHARS = 32  # experiments.progress_phase is VARCHAR(32)
STATUS = {"COMPLETED": Status.FAILED, "TIMEOUT": Status.TIMEOUT, "CANCELLED": Status.CANCELLED,
          "OUT_OF_MEMORY": Status.OOM, "DEADLINE": Status.TIMEOUT}
"""SLURM's final state -> ours when there is no result (COMPLETED without ranks.json is still a failure)."""


def run_on_slurm(spec: ExperimentSpec, *, workdir: Path, on_progress: Callable[[dict], None] | None = None,
                 cancel: threading.Event | None = None, extra_env: dict | None = None,
                 config: SlurmConfig | None = None, detach: threading.Event | None = None,
                 run_uid: str | None = None, adopt: bool = False) -> RunResult:
    """Raises reattach.Detached when `detach` is set (the worker is stopping): the job keeps running.

    run_uid binds the run folder to the run (backend/run_folders): a fresh run (adopt=False) sets aside any
    folder another run left under its id and submits; an adopted run re-attaches only to a slurm.json carrying
    its uid (or none: written before uids existed), and takes a bound result.json already collected as is.
    Without run_uid (older callers) an existing slurm.json is followed, as before."""
    cfg = config or load()
    workdir = (cfg.run_dir / Path(workdir).name).resolve()
    if run_uid is not None and adopt and (done := run_folders.bound_result(workdir, run_uid)) is not None:
        return done
    started_at, t0 = _now(), time.monotonic()
    launch: dict = {"executor": "slurm", "script": str(workdir / SCRIPT_NAME)}
    try:
        job_id = _attach_or_submit(spec, cfg, workdir, extra_env, launch, run_uid, adopt)
    except (slurm.SlurmError, ValueError, OSError) as e:
        result = failed_result(spec, Failure(Status.FAILED, f"could not submit to SLURM: {e}"), launch)
    else:
        result = _follow(spec, workdir, job_id, launch, on_progress, cancel, detach)
    result.started_at, result.finished_at = started_at, _now()
    result.wall_s = time.monotonic() - t0
    keep_result(workdir, result)  # a full disk costs result.json, never the finished job's result
    return result


def _attach_or_submit(spec, cfg, workdir: Path, extra_env, launch: dict, run_uid: str | None, adopt: bool) -> str:
    record = workdir / "slurm.json"
    experiment_id = int(workdir.name) if workdir.name.isdigit() else 0
    if run_uid is not None and not adopt:
        run_folders.prepare(workdir, experiment_id, run_uid)  # another run's slurm.json must never be followed
    elif record.exists():  # this experiment's job was submitted before (a worker restart): follow it, never resubmit
        data = json.loads(record.read_text())
        if run_uid is not None and data.get("run_uid") not in (None, run_uid):
            raise ValueError(f"run folder {workdir} belongs to another run (run_uid {data['run_uid']}, this run "
                             f"{run_uid}): not re-attaching to its SLURM job {data.get('job_id')}")
        launch.update(job_id=data["job_id"], reattached=True)
        return data["job_id"]
    workdir.mkdir(parents=True, exist_ok=True)
    clear_outputs(workdir)
    write_atomic(workdir / "spec.json", spec.to_json())
    script = workdir / SCRIPT_NAME
    write_atomic(script, build_script(spec, cfg, experiment_id=experiment_id, workdir=workdir))
    # not the worker's id: a restarted worker kills processes carrying a dead worker's id, and this job outlives it
    job_env = {k: v for k, v in (extra_env or {}).items() if k != WORKER_ENV}
    job_id = slurm.submit(script, env={k: v for k, v in slurm.client_env(job_env).items() if k != WORKER_ENV})
    write_atomic(record, json.dumps({"job_id": job_id, "submitted_at": _now(), "experiment_id": experiment_id,
                                     **({"run_uid": run_uid} if run_uid else {})}))
    launch.update(job_id=job_id, reattached=False)
    return job_id


def _follow(spec, workdir: Path, job_id: str, launch: dict, on_progress, cancel, detach=None) -> RunResult:
    on_line = progress_reader(on_progress) if on_progress else None
    out = output_path(workdir, job_id)
    offset, cancelled, state, seen = 0, False, slurm.JobState("PENDING"), None
    while True:
        if detach is not None and detach.is_set():
            raise Detached(job_id)
        if cancel is not None and cancel.is_set() and not cancelled:
            slurm.cancel(job_id)
            cancelled = True
        state = slurm.query(job_id)
        if state.finished:
            break
        if on_progress and (state.state, state.reason) != seen:
            seen = (state.state, state.reason)
            detail = state.reason if state.state != "RUNNING" else state.nodes
            on_progress({"phase": f"slurm {state.state} {detail}".strip()[:PHASE_CHARS]})
        offset = _feed(out, offset, on_line)
        time.sleep(POLL_S)
    _feed(out, offset, on_line)
    launch.update(slurm_state=state.state, slurm_reason=state.reason, nodes=state.nodes, exit_code=state.exit_code)
    return _collect(spec, workdir, job_id, state, launch, _tail(out), cancelled)


def _collect(spec, workdir: Path, job_id: str, state: slurm.JobState, launch: dict, tail: str,
             cancelled: bool) -> RunResult:
    if state.state == "COMPLETED" and ranks_path(workdir).exists():
        return assembled_result(spec, workdir, None, launch, tail)
    said = f"SLURM job {job_id} {state.state}" + (f" (reason: {state.reason})" if state.reason else "")
    said += f", exit code {state.exit_code}" if state.exit_code and state.exit_code != "0:0" else ""
    if state.state == "VANISHED":
        said = f"SLURM job {job_id} vanished from the queue without a result ({state.reason or 'no record left'})"
    if cancelled or state.state == "CANCELLED":
        return failed_result(spec, Failure(Status.CANCELLED, f"{said}: cancelled"), launch, tail)
    own = outcome.classify_exit(workdir, 1, tail) if any_rank_error(workdir) else None
    status = STATUS.get(state.state, Status.FAILED)
    if own is not None:
        status = Status.OOM if own.status == Status.OOM else status
        return failed_result(spec, Failure(status, f"{said}; {own.error}", own.failing_rank, own.traceback), launch,
                             tail)
    return failed_result(spec, Failure(status, f"{said}; no rank reported an error (see log tail)"), launch, tail)


def _feed(path: Path, offset: int, on_line) -> int:
    """Pass the job output's new complete lines to on_line; returns the new offset."""
    if on_line is None or not path.exists():
        return offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode("utf-8", "replace").splitlines():
        on_line(line)
    return offset + end


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()[-TAIL_CHARS:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
