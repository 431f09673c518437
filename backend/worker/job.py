"""One job of the worker: run a claimed experiment to its end and store its result, whatever the store does.

A mixin of backend.worker.service.Worker (it uses the worker's engine, runs folder, stop event and runner). The result
is written to the run folder's result.json first, the source of truth until the store has it: store writes are
retried for as long as the worker lives (backend/worker/store_guard); a worker stopped mid-outage leaves it for the
next worker to import. A launch that fails because of the host (backend.worker.recovery.ENVIRONMENT_ERRNOS)
puts the job back in the queue instead of failing it.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from pathlib import Path

from backend import run_folders
from backend.atomic_io import write_atomic
from backend.cluster.reattach import Detached
from backend.result import RunResult, Status
from backend.spec import ExperimentSpec, validate_spec
from backend.worker import recovery
from backend.worker.store_guard import Backoff, is_transient, retry, short
from db import queries as q
from db.session import StoreError

log = logging.getLogger("shardlab.worker")
EXPERIMENT_ENV = "SHARDLAB_EXPERIMENT_ID"
WORKER_ENV = recovery.WORKER_ENV


class JobExecution:
    def _retry(self, fn, what: str, give_up_after_stop_s: float = 0.0):
        return retry(fn, what, stop=self.stopping, give_up_after_stop_s=give_up_after_stop_s, engine=self.engine,
                     backoff=Backoff(max_s=self.max_backoff_s), stopped_at=lambda: self.stopped_at)

    def execute(self, experiment_id: int, worker_id: str, *, adopted: bool = False) -> RunResult | None:
        """Run a claimed experiment to its end and store the result (never raises for a failed run)."""
        row = self._retry(lambda: q.get_experiment(self.engine, experiment_id), f"reading experiment {experiment_id}")
        if row is None:
            log.warning("experiment %s vanished from the store after it was claimed", experiment_id)
            return None
        if row["spec"] is None:
            return self._unreadable(experiment_id, row["spec_error"])
        spec: ExperimentSpec = row["spec"]
        local = spec.runtime.executor != "slurm" or self.runner is not None
        workdir = self.runs_dir / str(experiment_id)
        if local and not adopted:
            try:
                run_folders.prepare(workdir, experiment_id, row["run_uid"])
            except OSError as e:
                if recovery.is_environment_error(e):
                    return self._environment_failure(experiment_id, worker_id, e)
                self._store(experiment_id, _raised(spec, e), None)
                return None
        cancel = threading.Event()
        with self._lock:
            self._cancels[experiment_id] = cancel
        if self.stopping.is_set():
            cancel.set()
        self._beat_running(worker_id, experiment_id)
        log.info("experiment %s: %s world %s on %s", experiment_id, spec.parallel.strategy, spec.parallel.world_size,
                 worker_id)
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(experiment_id, worker_id, cancel, beat_stop), daemon=True)
        beat.start()
        tmp = recovery.job_tmpdir(experiment_id) if local else None
        try:
            with self._lock:
                self._jobs_running += 1
            result = self._run(spec, experiment_id, worker_id, cancel, run_uid=row["run_uid"], adopted=adopted,
                               tmpdir=tmp)
        except Detached:
            log.info("experiment %s: worker stopping, its SLURM job keeps running (the next worker re-attaches)",
                     experiment_id)
            return None
        except OSError as e:  # the launch failed because of the host (full disk, unwritable folder)
            return self._environment_failure(experiment_id, worker_id, e)
        finally:
            with self._lock:
                self._jobs_running -= 1  # the job's processes have ended (the runner returned or raised)
            beat_stop.set()
            beat.join(timeout=self.grace_left(10.0))  # a heartbeat waiting on a lock must not hold up a stop
            recovery.remove_job_tmpdir(tmp)
            with self._lock:
                self._cancels.pop(experiment_id, None)
        self._host_backoff.reset()
        if self.stopping.is_set() and result.status == Status.CANCELLED and not self._cancel_requested(experiment_id):
            result.status = Status.INTERRUPTED
            result.error = f"worker stopped (SIGTERM/SIGINT) during the run; {result.error or ''}".rstrip("; ")
        self._store(experiment_id, result, workdir if local else None)
        return result

    def _unreadable(self, experiment_id: int, reason: str) -> None:
        """A spec this version cannot read: the run fails with the reason, nothing is launched, the worker goes on."""
        log.error("experiment %s: not launched: %s", experiment_id, reason)
        self._retry(lambda: q.fail_unreadable(self.engine, experiment_id, reason),
                    f"failing experiment {experiment_id}")
        return None

    def _environment_failure(self, experiment_id: int, worker_id: str, error: OSError) -> None:
        """The host could not take the run: back to the queue (not failed: the run itself never started)."""
        self._runs_dir_ok_at = 0.0
        back = self._retry(lambda: q.release_claim(self.engine, experiment_id, worker_id), "re-queueing a job")
        wait = self._host_backoff.wait_s()
        log.warning("experiment %s: launch failed because of this host (%s); %s; %d such failure(s) in a row, claiming "
                    "again in %.1f s", experiment_id, error,
                    "put back in the queue" if back else "it was no longer ours", self._host_backoff.failures, wait)
        self.stopping.wait(wait)  # and the next loop round checks the runs folder before claiming
        return None

    def _cancel_requested(self, experiment_id: int) -> bool:
        """Whether the user cancelled (else a stopping worker's cancel is an interruption); not known while the
        store is away as the worker stops: then it is an interruption."""
        try:
            return self._retry(lambda: q.cancel_requested(self.engine, experiment_id), "reading a cancel request")
        except Exception as e:  # noqa: BLE001
            if is_transient(e):
                return False
            raise

    def _beat_running(self, worker_id: str, experiment_id: int) -> None:
        try:
            q.set_worker_state(self.engine, worker_id, "running", experiment_id)
        except Exception as e:  # noqa: BLE001 - the heartbeat thread retries
            if not is_transient(e):
                raise
            log.warning("worker state not updated: store unavailable (%s)", short(e))

    def _store(self, experiment_id: int, result: RunResult, workdir: Path | None) -> None:
        """Store the result; until that succeeds it stays in workdir/result.json (the source of truth) and in
        memory: a disk too full for result.json does not stop it from being stored, and while the store is away
        too, each retry tries the file again (issue 31: a finished run is never thrown away)."""
        kept = ResultFile(workdir / "result.json" if workdir is not None else None, experiment_id)
        kept.write(result)

        def store() -> None:
            kept.write(result)  # no-op once written; a retry after space came back leaves the file for the next worker
            q.store_result(self.engine, experiment_id, result)

        try:
            self._retry(store, f"storing the result of experiment {experiment_id}",
                        give_up_after_stop_s=self.stop_grace_s)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, StoreError):
                log.error("experiment %s: result not stored; %s", experiment_id, kept.where())
                raise
            if is_transient(e):
                log.error("experiment %s: the store is still away as the worker stops; %s", experiment_id,
                          kept.where())
                return
            log.exception("experiment %s: the store refused its result", experiment_id)
            kept_in = kept.path if kept.written and kept.path else "its run folder"
            refused = RunResult.of_spec(result.spec, status=Status.FAILED, error=f"the store refused this run's "
                                        f"{result.status} result ({short(e)}); the full result is kept in {kept_in}")
            self._retry(lambda: q.store_result(self.engine, experiment_id, refused), "storing a refused result")
        log.info("experiment %s: %s%s", experiment_id, result.status, f" ({result.error})" if result.error else "")

    def _run(self, spec: ExperimentSpec, experiment_id: int, worker_id: str, cancel: threading.Event, *,
             run_uid: str | None = None, adopted: bool = False, tmpdir: Path | None = None) -> RunResult:
        runner = self.runner
        if runner is None and spec.runtime.executor == "slurm":
            from backend.cluster.runner import run_on_slurm as runner
        if runner is None:
            from backend.launch.launcher import run_experiment as runner

        def on_progress(event: dict) -> None:
            try:
                if q.update_progress(self.engine, experiment_id, event.get("step"), event.get("of"),
                                     event.get("phase")):
                    cancel.set()
            except Exception as e:  # noqa: BLE001 - a busy database must not break the run; the heartbeat retries
                log.warning("progress update skipped (%s)", short(e))

        refusal = None if adopted else spec_refusal(spec)  # an adopted SLURM job is running already
        if (refusal := refusal or local_capacity_refusal(spec)) is not None:
            return RunResult.of_spec(spec, status=Status.FAILED, error=refusal)
        if spec.runtime.executor == "local":
            from backend.bench import cpu_profile

            if (note := cpu_profile.ensure(on_progress)) is not None:
                log.info("experiment %s: %s", experiment_id, note)
        extra_env = {**self._slot_env.get(worker_id, {}), WORKER_ENV: worker_id, EXPERIMENT_ENV: str(experiment_id)}
        if tmpdir is not None:
            extra_env["TMPDIR"] = str(tmpdir)
        kw = {}
        if spec.runtime.executor == "slurm" and self.runner is None:
            kw = {"detach": self.stopping, "run_uid": run_uid, "adopt": adopted}
        try:
            return runner(spec, workdir=self.runs_dir / str(experiment_id), on_progress=on_progress, cancel=cancel,
                          extra_env=extra_env, **kw)
        except Detached:
            raise
        except OSError as e:
            if recovery.is_environment_error(e):
                raise
            return _raised(spec, e)
        except Exception as e:  # noqa: BLE001
            return _raised(spec, e)

    def _heartbeat(self, experiment_id: int, worker_id: str, cancel: threading.Event, stop: threading.Event) -> None:
        """Heartbeat every heartbeat_s and poll cancel_requested every poll interval while the job runs."""
        last, failures = 0.0, 0
        while not stop.wait(min(self.poll_s, self.heartbeat_s)):
            try:
                if time.monotonic() - last >= self.heartbeat_s:
                    requested = q.heartbeat(self.engine, experiment_id, worker_id=worker_id)
                    last = time.monotonic()
                else:
                    requested = q.cancel_requested(self.engine, experiment_id)
                if requested:
                    cancel.set()
                failures = 0
            except Exception as e:  # noqa: BLE001
                if isinstance(e, StoreError):
                    self.fail(e)
                    return
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    log.warning("heartbeat of experiment %s skipped %d time(s): store unavailable (%s)",
                                experiment_id, failures, short(e))



class ResultFile:
    """A finished run's result.json: written once the disk takes it, and where the result is if it is not stored."""

    def __init__(self, path: Path | None, experiment_id: int):
        self.path, self.experiment_id = path, experiment_id
        self.written, self.error = path is None, None

    def write(self, result: RunResult) -> None:
        if self.written:
            return
        try:
            write_atomic(self.path, result.to_json())
            self.written = True
            if self.error is not None:
                log.warning("experiment %s: result.json written after all (%s)", self.experiment_id, self.path)
        except OSError as e:
            if self.error is None:
                log.warning("experiment %s: result.json not written (%s); storing from memory", self.experiment_id, e)
            self.error = e

    def where(self) -> str:
        if self.path is None:
            return "the result stays in its run folder for the next worker"
        if self.written:
            return f"the result stays in {self.path} and the next worker imports it"
        return f"the result could not be written to {self.path} either ({self.error}): it is lost with this worker"


def spec_refusal(spec: ExperimentSpec) -> str | None:
    """Why this version will not run a queued spec, checked before launching (None if it runs): today's rules for a new
    spec, which its ranks apply too; an older version may have queued one that a rule added since refuses."""
    _, problems = validate_spec(spec.model_dump(mode="json"))
    return f"not launched: this version does not run this spec: {'; '.join(problems)}" if problems else None


def local_capacity_refusal(spec: ExperimentSpec) -> str | None:
    """Why this host cannot run a local job (backend/launch/capacity.py), checked before launching; None if it can."""
    from backend.launch import capacity

    verdict = capacity.check(spec)
    return None if verdict.ok else f"not launched: {verdict.refusal()}"


def _raised(spec: ExperimentSpec, e: Exception) -> RunResult:
    return RunResult.of_spec(spec, status=Status.FAILED, error=f"the runner raised {type(e).__name__}: {e}",
                             traceback=traceback.format_exc())


