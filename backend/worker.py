"""The job worker: `python -m backend worker [--once] [--poll-s S] [--concurrency N]`.

Loop: claim the oldest queued experiment (atomic, BEGIN IMMEDIATE), run it with
`backend.launch.launcher.run_experiment` in `<runs_dir>/<id>`, stream progress and heartbeats into the
store, turn a cancel request into the launcher's cancel Event, and store the complete result in one
transaction. failed/timeout/oom runs are stored like ok ones (spec, predicted memory, error, failing
rank, log tail). On start it marks as interrupted the jobs of dead workers on this host (and kills
their orphaned job processes) and any running job whose heartbeat is stale.

SIGTERM/SIGINT stop the worker cleanly: the current job's processes are ended and it is stored as
`interrupted` (error "worker stopped ..."), so it can be re-queued; a user's cancel stays `cancelled`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import psutil

from backend.cluster.reattach import Detached
from backend.result import RunResult, Status
from backend.spec import ExperimentSpec
from db import queries as q
from db.session import REPO, sqlite_path

log = logging.getLogger("shardlab.worker")
WORKER_ENV = "SHARDLAB_WORKER_ID"
EXPERIMENT_ENV = "SHARDLAB_EXPERIMENT_ID"
Runner = Callable[..., RunResult]


def default_runs_dir(engine) -> Path:
    """Beside the SQLite file (data/runs for the default data/shardlab.db), else <repo>/data/runs."""
    path = sqlite_path(str(engine.url.render_as_string(hide_password=False)))
    return (path.parent if path else REPO / "data") / "runs"


class Worker:
    def __init__(self, engine, *, runs_dir: Path | None = None, poll_s: float = 1.0, heartbeat_s: float = 5.0,
                 stale_after_s: float = 60.0, runner: Runner | None = None):
        self.engine = engine
        self.runs_dir = Path(runs_dir) if runs_dir else default_runs_dir(engine)
        self.poll_s, self.heartbeat_s, self.stale_after_s = poll_s, heartbeat_s, stale_after_s
        self.runner = runner
        self.host = socket.gethostname()
        self.stopping = threading.Event()
        self._cancels: dict[int, threading.Event] = {}
        # reentrant: stop() runs in signal handlers, and a second signal can arrive while the first holds it
        self._lock = threading.RLock()
        self._slot_env: dict[str, dict[str, str]] = {}
        """worker (slot) id -> environment its jobs get (CUDA_VISIBLE_DEVICES: this slot's GPUs)."""

    # ---- lifecycle -----------------------------------------------------------------------------

    def slot_id(self, slot: int) -> str:
        return f"{self.host}:{os.getpid()}:{slot}"

    def recover(self) -> list[int]:
        """Interrupt the jobs of dead local workers (killing their orphans) and of stale heartbeats."""
        dead = q.recover_dead_workers(self.engine, self.host)
        kill_orphans(dead_worker_ids(self.engine, self.host))
        stale = q.recover_stale(self.engine, self.stale_after_s)
        for eid in dead + stale:
            log.warning("experiment %s marked interrupted (its worker is gone)", eid)
        return dead + stale

    def stop(self) -> None:
        """Stop after the current job; the running job is cancelled and stored as interrupted."""
        self.stopping.set()
        with self._lock:
            for event in self._cancels.values():
                event.set()

    def serve(self, *, once: bool = False, drain: bool = False, concurrency: int = 1) -> int:
        """Run jobs until stopped (once: at most one job per slot; drain: until the queue is empty)."""
        adopted = self._adopt_slurm_jobs()
        self.recover()
        self.assign_gpus(concurrency)
        slots = [threading.Thread(target=self._loop, args=(i, once, drain), name=f"worker-{i}", daemon=True)
                 for i in range(max(1, concurrency))]
        for t in slots:
            t.start()
        while any(t.is_alive() for t in slots + adopted):
            for t in slots + adopted:
                t.join(timeout=0.5)
        if adopted:
            q.set_worker_state(self.engine, f"{self.host}:{os.getpid()}:adopt", "stopped")
        return 0

    def assign_gpus(self, concurrency: int) -> None:
        """With several slots, give each its own CUDA_VISIBLE_DEVICES (gpu_slots), so concurrent jobs never share
        a GPU; one slot keeps the worker's environment."""
        if concurrency <= 1:
            return
        for i, gpus in enumerate(gpu_slots(concurrency, visible_gpus())):
            if gpus is not None:
                self._slot_env[self.slot_id(i)] = {"CUDA_VISIBLE_DEVICES": gpus}

    def _adopt_slurm_jobs(self) -> list[threading.Thread]:
        """Follow the SLURM jobs of gone workers to their end (see backend.cluster.reattach), one thread each."""
        from backend.cluster.reattach import adopt

        wid, me = f"{self.host}:{os.getpid()}:adopt", psutil.Process()
        # a live row first, so that a worker starting beside this one does not adopt the same jobs again
        q.register_worker(self.engine, wid, pid=me.pid, host=self.host, pid_started=me.create_time())
        ids = adopt(self.engine, wid, self.host, stale_after_s=self.stale_after_s)
        q.set_worker_state(self.engine, wid, "running" if ids else "stopped", ids[0] if ids else None)
        threads = [threading.Thread(target=self.execute, args=(eid, wid), name=f"slurm-{eid}", daemon=True) for eid in ids]
        for eid, t in zip(ids, threads):
            log.info("experiment %s: re-attached to its SLURM job", eid)
            t.start()
        return threads

    def _loop(self, slot: int, once: bool, drain: bool) -> None:
        wid = self.slot_id(slot)
        me = psutil.Process()
        q.register_worker(self.engine, wid, pid=me.pid, host=self.host, pid_started=me.create_time())
        last_beat = 0.0
        try:
            while not self.stopping.is_set():
                eid = q.claim_next(self.engine, wid, host=self.host)
                if eid is None:
                    if once or drain:
                        break
                    if time.monotonic() - last_beat >= self.heartbeat_s:
                        q.set_worker_state(self.engine, wid, "idle")
                        last_beat = time.monotonic()
                    self.stopping.wait(self.poll_s)
                    continue
                last_beat = 0.0
                try:
                    self.execute(eid, wid)
                except Exception:  # the store failed even after retries: the job stays running until recovered as stale
                    log.exception("experiment %s: could not store its result", eid)
                    self.stopping.wait(self.poll_s)
                if once:
                    break
        finally:
            q.set_worker_state(self.engine, wid, "stopped")

    # ---- one job -------------------------------------------------------------------------------

    def execute(self, experiment_id: int, worker_id: str) -> RunResult | None:
        """Run a claimed experiment to its end and store the result (never raises for a failed run)."""
        row = q.get_experiment(self.engine, experiment_id)
        spec: ExperimentSpec = row["spec"]
        cancel = threading.Event()
        with self._lock:
            self._cancels[experiment_id] = cancel
        if self.stopping.is_set():
            cancel.set()
        q.set_worker_state(self.engine, worker_id, "running", experiment_id)
        log.info("experiment %s: %s world %s on %s", experiment_id, spec.parallel.strategy, spec.parallel.world_size, worker_id)
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(experiment_id, worker_id, cancel, beat_stop), daemon=True)
        beat.start()
        try:
            result = self._run(spec, experiment_id, worker_id, cancel)
        except Detached:
            log.info("experiment %s: worker stopping, its SLURM job keeps running (the next worker re-attaches)", experiment_id)
            return None
        finally:
            beat_stop.set()
            beat.join(timeout=10)
            with self._lock:
                self._cancels.pop(experiment_id, None)
        if self.stopping.is_set() and result.status == Status.CANCELLED and not q.cancel_requested(self.engine, experiment_id):
            result.status = Status.INTERRUPTED
            result.error = f"worker stopped (SIGTERM/SIGINT) during the run; {result.error or ''}".rstrip("; ")
        _retry(lambda: q.store_result(self.engine, experiment_id, result))
        log.info("experiment %s: %s%s", experiment_id, result.status, f" ({result.error})" if result.error else "")
        return result

    def _run(self, spec: ExperimentSpec, experiment_id: int, worker_id: str, cancel: threading.Event) -> RunResult:
        runner = self.runner
        if runner is None and spec.runtime.executor == "slurm":
            from backend.cluster.runner import run_on_slurm as runner
        if runner is None:
            from backend.launch.launcher import run_experiment as runner

        def on_progress(event: dict) -> None:
            try:
                if q.update_progress(self.engine, experiment_id, event.get("step"), event.get("of"), event.get("phase")):
                    cancel.set()
            except Exception:  # a busy database must not break the run; the heartbeat retries
                log.exception("progress update failed")

        if (refusal := local_capacity_refusal(spec)) is not None:
            return RunResult(status=Status.FAILED, spec=spec, error=refusal)
        if spec.runtime.executor == "local":
            from backend.bench import cpu_profile

            if (note := cpu_profile.ensure(on_progress)) is not None:
                log.info("experiment %s: %s", experiment_id, note)
        extra_env = {**self._slot_env.get(worker_id, {}), WORKER_ENV: worker_id, EXPERIMENT_ENV: str(experiment_id)}
        kw = {"detach": self.stopping} if spec.runtime.executor == "slurm" and self.runner is None else {}
        try:
            return runner(spec, workdir=self.runs_dir / str(experiment_id), on_progress=on_progress, cancel=cancel,
                          extra_env=extra_env, **kw)
        except Detached:
            raise
        except Exception as e:
            return RunResult(status=Status.FAILED, spec=spec, error=f"the runner raised {type(e).__name__}: {e}",
                             traceback=traceback.format_exc())

    def _heartbeat(self, experiment_id: int, worker_id: str, cancel: threading.Event, stop: threading.Event) -> None:
        """Heartbeat every heartbeat_s and poll cancel_requested every poll interval while the job runs."""
        last = 0.0
        while not stop.wait(min(self.poll_s, self.heartbeat_s)):
            try:
                if time.monotonic() - last >= self.heartbeat_s:
                    requested = q.heartbeat(self.engine, experiment_id, worker_id=worker_id)
                    last = time.monotonic()
                else:
                    requested = q.cancel_requested(self.engine, experiment_id)
                if requested:
                    cancel.set()
            except Exception:
                log.exception("heartbeat failed")


def local_capacity_refusal(spec: ExperimentSpec) -> str | None:
    """Why this host cannot run a local job (backend/launch/capacity.py), checked before launching; None if it can."""
    from backend.launch import capacity

    verdict = capacity.check(spec)
    return None if verdict.ok else f"not launched: {verdict.refusal()}"


def visible_gpus() -> list[str]:
    """The GPU ids this worker may use: CUDA_VISIBLE_DEVICES when set, else every device torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def gpu_slots(concurrency: int, gpus: list[str]) -> list[str | None]:
    """Disjoint GPU sets for `concurrency` worker slots (CUDA_VISIBLE_DEVICES values), so concurrent jobs never
    share a device; None per slot without GPUs (CPU jobs). Raises when there are fewer GPUs than slots."""
    if not gpus:
        return [None] * concurrency
    if len(gpus) < concurrency:
        raise ValueError(f"--concurrency {concurrency} needs at least one GPU per slot, but {len(gpus)} are visible "
                         f"({','.join(gpus)}): {len(gpus)} < {concurrency}")
    k = len(gpus) // concurrency  # each slot gets k GPUs; the remainder (len % concurrency) stays unused
    return [",".join(gpus[i * k:(i + 1) * k]) for i in range(concurrency)]


def _retry(fn, attempts: int = 5, wait_s: float = 2.0):
    """Retry a store write on OperationalError (e.g. a disk briefly full or locked past busy_timeout)."""
    from sqlalchemy.exc import OperationalError

    for attempt in range(attempts):
        try:
            return fn()
        except OperationalError:
            if attempt == attempts - 1:
                raise
            log.warning("store busy, retrying in %.0f s", wait_s)
            time.sleep(wait_s)


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


def install_signal_handlers(worker: Worker) -> None:
    def _handler(signum, _frame) -> None:
        log.warning("signal %s: stopping; the running job is interrupted", signum)
        worker.stop()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
