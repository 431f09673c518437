"""What a worker does besides running jobs: recover the work of workers that are gone, import results that
never reached the store, and check that the host can hold another run before claiming one.

Order matters (issue 21): a finished `result.json` on disk is the source of truth until it is stored, so
`import_results` runs before anything is marked interrupted; only runs with no result on disk and a dead
worker (or a stale heartbeat) become `interrupted`. Live workers repeat this as they poll, not only at start.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

from backend import run_folders
from backend.launch import outcome, procs
from backend.result import Status
from db import queries as q

log = logging.getLogger("shardlab.worker")
WORKER_ENV = "SHARDLAB_WORKER_ID"
JOB_TMP_PREFIX = "shardlab-job-"
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EMFILE,
                      errno.ENFILE}
"""A launch failing with one of these failed because of the host (full disk, read-only or unwritable folder,
no file handles), not because of the run: the job goes back to the queue and the worker pauses."""
PROBE_BYTES = 64 * 1024


def is_environment_error(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS


def runs_dir_problem(runs_dir: Path, min_free_bytes: int) -> str | None:
    """Why the runs folder cannot take another run now (None when it can): it must exist or be creatable, have
    min_free_bytes free, and take a 64 KiB file written and fsynced (a full or read-only disk fails here)."""
    probe = Path(runs_dir) / f".probe-{os.getpid()}"
    try:
        Path(runs_dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(runs_dir).free
        if free < min_free_bytes:
            return (f"runs folder {runs_dir} has {free / 2**20:.1f} MiB free, below the {min_free_bytes / 2**20:.0f} "
                    "MiB a run needs (worker --min-free-mb)")
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"runs folder {runs_dir} cannot take a run: {e}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def job_tmpdir(experiment_id: int) -> Path | None:
    """A temp folder of the job's own (TMPDIR for torchrun and the ranks: torchelastic's log folders land
    there), removed after the run by `remove_job_tmpdir`; None when the temp folder cannot be created."""
    try:
        return Path(tempfile.mkdtemp(prefix=f"{JOB_TMP_PREFIX}{int(experiment_id)}-"))
    except OSError as e:
        log.warning("experiment %s: no temp folder of its own (%s): torchrun uses the shared one", experiment_id, e)
        return None


def remove_job_tmpdir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def import_results(engine, runs_dir: Path, host: str, stale_after_s: float | None,
                   skip: set[int] = frozenset()) -> list[int]:
    """Store every bound result.json under runs_dir whose experiment is still running and whose worker is gone
    (it died, or was stopped while the store was away); returns the imported ids. A live worker's run is its own
    to store (db.workers.gone_worker_ids says which are gone; stale heartbeats only with stale_after_s)."""
    from db.workers import gone_worker_ids

    running = q.list_experiments(engine, status=str(Status.RUNNING), columns=["id", "worker_id"])
    gone = gone_worker_ids(engine, host, stale_after_s)
    known = {w["id"] for w in q.worker_heartbeats(engine)}
    orphaned = [r["id"] for r in running if r["id"] not in skip
                and (r["worker_id"] in gone or r["worker_id"] not in known)]
    uids = q.run_uids(engine, orphaned) if orphaned else {}
    imported = []
    for eid, uid in sorted(uids.items()):
        result = run_folders.bound_result(Path(runs_dir) / str(eid), uid)
        if result is None:
            continue
        q.store_result(engine, eid, result)
        imported.append(eid)
        log.warning("experiment %s: imported %s (status %s) from %s, left on disk by a worker that could not store it",
                    eid, "result.json", result.status, Path(runs_dir) / str(eid))
    return imported


def recover(engine, runs_dir: Path, host: str, stale_after_s: float | None, *, skip: set[int] = frozenset(),
            orphans_done: set[str] | None = None) -> list[int]:
    """Mark dead the local workers whose process is gone, import the results they left on disk, then interrupt
    their remaining jobs (killing their orphans) and, unless stale_after_s is None, those of heartbeats older than
    that; returns the interrupted ids. orphans_done: dead workers already swept (scanning every process costs
    ~0.1 s, and this runs every few seconds), updated in place."""
    from db.workers import interrupt_jobs_of_dead_workers, mark_dead_workers

    mark_dead_workers(engine, host)  # first: a worker dying between the import and the interrupt is seen next round
    import_results(engine, runs_dir, host, stale_after_s, skip=skip)
    explain = _explainer(runs_dir)
    dead = interrupt_jobs_of_dead_workers(engine, host, explain)
    gone = dead_worker_ids(engine, host)
    kill_orphans(gone - (orphans_done or set()))
    if orphans_done is not None:
        orphans_done |= gone
    stale = q.recover_stale(engine, stale_after_s, explain) if stale_after_s is not None else []
    for eid in dead + stale:
        log.warning("experiment %s marked interrupted (its worker is gone and no result was left on disk)", eid)
    return dead + stale


def left_behind(folder: Path, run_uid: str | None) -> q.LeftBehind | None:
    """What an interrupted run's own folder says about how it ended: the tail of its log.txt and the first failing
    rank's error record, read as the launcher reads them for a job it stops (procs.Job.tail's window,
    outcome.from_rank_errors); None for a folder not bound to the run (backend/run_folders.py)."""
    if not run_uid or not run_folders.bound_to(folder, run_uid):
        return None
    tail, failure = procs.log_tail(folder / "log.txt"), outcome.from_rank_errors(folder)
    if failure is None:
        return q.LeftBehind(log_tail=tail)
    return q.LeftBehind(log_tail=tail, error=f"first rank error on record: {failure.error}",
                        failing_rank=failure.failing_rank, traceback=failure.traceback)


def _explainer(runs_dir: Path) -> q.Explain:
    return lambda eid, uid: left_behind(Path(runs_dir) / str(eid), uid)


def dead_worker_ids(engine, host: str) -> set[str]:
    return {w["id"] for w in q.worker_heartbeats(engine) if w["host"] == host and w["state"] == "dead"}


def kill_orphans(worker_ids: set[str]) -> int:
    """SIGKILL job processes left behind by dead workers (found by the SHARDLAB_WORKER_ID they inherited)."""
    if not worker_ids:
        return 0
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(WORKER_ENV) in worker_ids:
                found.append(p)
        except psutil.Error:
            continue
    for p in found:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(found, timeout=5)
    return len(found)
