"""The job worker: `python -m backend worker [--once] [--poll-s S] [--concurrency N]`.

Loop: claim the oldest queued experiment (atomic, BEGIN IMMEDIATE), run it with
`backend.launch.launcher.run_experiment` in `<runs_dir>/<id>` (stamped with the run's uid, backend/run_folders),
stream progress and heartbeats into the store, turn a cancel request into the launcher's cancel Event, and
store the complete result in one transaction. failed/timeout/oom runs are stored like ok ones.

Faults (issue 21): the store may be away (a PostgreSQL restart, a SQLite lock, a full disk): every store call
is retried with backoff and a log line (backend/worker/store_guard), and a finished result stays in `result.json`
until it is stored, by this worker or, if it dies, by the next one (backend/worker/recovery imports results
before marking anything interrupted, at start and every `recover_every_s` while polling). A store file that
vanished or was replaced stops the worker with exit code 2. A runs folder that cannot take a run (full,
read-only) pauses claiming with the reason logged; a job whose launch failed that way goes back to the queue.

SIGTERM/SIGINT stop the worker cleanly: the current job's processes are ended and it is stored as
`interrupted` (error "worker stopped ..."), so it can be re-queued; a user's cancel stays `cancelled`. Store calls
after the stop get `stop_grace_s` (10 s) in all: a lock held by another process is waited for only that long
(db.session.bound_waits), and once the grace is over and no job's processes run, the worker exits without waiting
for the store (a result it could not store stays in result.json for the next worker).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from backend import run_folders
from backend.result import RunResult
from backend.worker import recovery
from backend.worker.job import EXPERIMENT_ENV, JobExecution  # noqa: F401 - EXPERIMENT_ENV is part of the API
from backend.worker.store_guard import MAX_WAIT_S, Backoff, is_transient, short
from db import queries as q
from db.session import StoreError, bound_waits

log = logging.getLogger("shardlab.worker")
WORKER_ENV = recovery.WORKER_ENV
Runner = Callable[..., RunResult]
default_runs_dir = run_folders.default_runs_dir
kill_orphans = recovery.kill_orphans
DEFAULT_MIN_FREE_BYTES = 64 * 2**20
EXIT_STORE_ERROR = 2
EXIT_BUG = 1
RUNS_DIR_CHECK_S = 5.0
STOP_GRACE_S = 10.0
"""How long a stopping worker's store calls may take in all, counted from the stop (SIGTERM)."""


class Worker(JobExecution):
    def __init__(self, engine, *, runs_dir: Path | None = None, poll_s: float = 1.0, heartbeat_s: float = 5.0,
                 stale_after_s: float = 60.0, runner: Runner | None = None, recover_every_s: float | None = None,
                 min_free_bytes: int = DEFAULT_MIN_FREE_BYTES):
        self.engine = engine
        self.runs_dir = Path(runs_dir) if runs_dir else default_runs_dir(engine)
        self.poll_s, self.heartbeat_s, self.stale_after_s = poll_s, heartbeat_s, stale_after_s
        self.recover_every_s = (recover_every_s if recover_every_s is not None
                                else min(30.0, max(2.0, stale_after_s / 4)))
        self.min_free_bytes = min_free_bytes
        self.max_backoff_s = MAX_WAIT_S
        """Longest wait between two tries of an unavailable store (and between two looks at a full runs folder)."""
        self.stop_grace_s = STOP_GRACE_S
        """After a stop, store calls (the interrupted result, the worker rows) get this long in all."""
        self.stopped_at: float | None = None
        """time.monotonic() of the first stop() (None while running)."""
        self._jobs_running = 0
        self._host_backoff = Backoff(first_s=1.0)
        """Launches failing in a row because of the host: 1, 2, 4 ... 30 s between claims."""
        self.runner = runner
        self.host = socket.gethostname()
        self.stopping = threading.Event()
        self.exit_code = 0
        self._cancels: dict[int, threading.Event] = {}
        # reentrant: stop() runs in signal handlers, and a second signal can arrive while the first holds it
        self._lock = threading.RLock()
        self._slot_env: dict[str, dict[str, str]] = {}
        """worker (slot) id -> environment its jobs get (CUDA_VISIBLE_DEVICES: this slot's GPUs)."""
        self._following: list[threading.Thread] = []
        self._paused_for: str | None = None
        self._orphans_done: set[str] = set()
        """Dead workers whose orphaned job processes this worker has already looked for."""
        self._store_up_since: float | None = None
        """Since when (monotonic) every store call of this worker has worked; None during an outage."""
        self._runs_dir_ok_at = 0.0

    # ---- lifecycle -----------------------------------------------------------------------------

    def slot_id(self, slot: int) -> str:
        return f"{self.host}:{os.getpid()}:{slot}"

    def recover(self) -> list[int]:
        """Import results left on disk, then interrupt the jobs of dead local workers and of stale heartbeats.
        A heartbeat is judged stale only once this worker has reached the store for stale_after_s without a
        break: during an outage nobody could heartbeat, and a live job must not be taken for a dead one."""
        with self._lock:
            mine = set(self._cancels)
        up = self._store_up_since
        stale_s = self.stale_after_s if up is not None and time.monotonic() - up >= self.stale_after_s else None
        return recovery.recover(self.engine, self.runs_dir, self.host, stale_s, skip=mine,
                                orphans_done=self._orphans_done)

    def _store_seen(self, up: bool) -> None:
        if not up:
            self._store_up_since = None
        elif self._store_up_since is None:
            self._store_up_since = time.monotonic()

    def stop(self) -> None:
        """Stop after the current job; the running job is cancelled and stored as interrupted, within stop_grace_s."""
        with self._lock:
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
                bound_waits(self.engine, self.stopped_at + self.stop_grace_s)
            self.stopping.set()
            for event in self._cancels.values():
                event.set()

    def grace_left(self, cap_s: float) -> float:
        """Seconds left of the stop grace (cap_s while not stopping)."""
        if self.stopped_at is None:
            return cap_s
        return max(0.0, min(cap_s, self.stopped_at + self.stop_grace_s - time.monotonic()))

    def fail(self, error: BaseException) -> None:
        """Stop the whole worker for an error no retry can fix (exit code 2 for the store, 1 for anything else)."""
        if isinstance(error, StoreError):
            log.critical("%s", error)
            self.exit_code = self.exit_code or EXIT_STORE_ERROR
        else:
            log.critical("worker stopping on an unexpected error", exc_info=error)
            self.exit_code = self.exit_code or EXIT_BUG
        self.stop()

    def serve(self, *, once: bool = False, drain: bool = False, concurrency: int = 1) -> int:
        """Run jobs until stopped (once: at most one job per slot; drain: until the queue is empty); the exit code."""
        try:
            self._startup(concurrency)
        except Exception as e:  # noqa: BLE001 - a stop during the wait for the store, or a configuration error
            if not self.stopping.is_set() or isinstance(e, StoreError):
                self.fail(e)
            return self.exit_code
        slots = [threading.Thread(target=self._loop, args=(i, once, drain), name=f"worker-{i}", daemon=True)
                 for i in range(max(1, concurrency))]
        for t in slots:
            t.start()
        last_check = time.monotonic()
        while any(t.is_alive() for t in slots + self._following):
            for t in slots + self._following:
                t.join(timeout=0.5)
            if self.stopping.is_set() and self.grace_left(1.0) == 0.0 and not self._jobs_running:
                log.warning("stop grace of %g s is over: exiting without waiting for the store any longer (a result "
                            "not stored stays in its run folder's result.json for the next worker)", self.stop_grace_s)
                return self.exit_code
            if not once and not self.stopping.is_set() and time.monotonic() - last_check >= self.recover_every_s:
                self._housekeeping()
                last_check = time.monotonic()
        self._beat(f"{self.host}:{os.getpid()}:adopt", "stopped")
        return self.exit_code

    def _startup(self, concurrency: int) -> None:
        from db.session import init_db

        self._retry(lambda: init_db(self.engine), "opening the store")
        self._store_seen(True)
        self.assign_gpus(concurrency)
        me = psutil.Process()
        # a live row first, so that a worker starting beside this one does not adopt the same jobs again
        self._retry(lambda: q.register_worker(self.engine, f"{self.host}:{os.getpid()}:adopt", pid=me.pid,
                                              host=self.host, pid_started=me.create_time()), "registering the worker")
        self._retry(self._adopt_and_recover, "recovering the work of gone workers")

    def _housekeeping(self) -> None:
        """Between polls: the start-up recovery again, so a dead worker's job is noticed while this one lives."""
        try:
            self._adopt_and_recover()
            self._store_seen(True)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, StoreError):
                self.fail(e)
            elif is_transient(e):
                self._store_seen(False)
                log.warning("recovery skipped this round: store unavailable (%s)", short(e))
            else:  # a bug here must not take the worker (and its running job) down: next round tries again
                log.exception("recovery failed this round")

    def _adopt_and_recover(self) -> None:
        self._adopt_slurm_jobs()
        self.recover()

    def assign_gpus(self, concurrency: int) -> None:
        """With several slots, give each its own CUDA_VISIBLE_DEVICES (gpu_slots), so concurrent jobs never share
        a GPU; one slot keeps the worker's environment."""
        if concurrency <= 1:
            return
        for i, gpus in enumerate(gpu_slots(concurrency, visible_gpus())):
            if gpus is not None:
                self._slot_env[self.slot_id(i)] = {"CUDA_VISIBLE_DEVICES": gpus}

    def _adopt_slurm_jobs(self) -> None:
        """Follow the SLURM jobs of gone workers to their end (see backend.cluster.reattach), one thread each."""
        from backend.cluster.reattach import adopt

        wid = f"{self.host}:{os.getpid()}:adopt"
        up = self._store_up_since
        stale_s = self.stale_after_s if up is not None and time.monotonic() - up >= self.stale_after_s else float("inf")
        ids = adopt(self.engine, wid, self.host, stale_after_s=stale_s)  # stale heartbeats judged as in recover()
        self._following = [t for t in self._following if t.is_alive()]
        if ids or not self._following:
            q.set_worker_state(self.engine, wid, "running" if ids else "stopped", ids[0] if ids else None)
        for eid in ids:
            t = threading.Thread(target=self._follow, args=(eid, wid), name=f"slurm-{eid}", daemon=True)
            log.info("experiment %s: re-attached to its SLURM job", eid)
            t.start()
            self._following.append(t)

    def _follow(self, eid: int, wid: str) -> None:
        try:
            self.execute(eid, wid, adopted=True)
        except Exception as e:  # noqa: BLE001
            if not is_transient(e):
                self.fail(e)
            else:  # stopping during an outage: still running, the next worker adopts it
                log.error("experiment %s: left running (%s)", eid, short(e))

    def _loop(self, slot: int, once: bool, drain: bool) -> None:
        wid = self.slot_id(slot)
        me = psutil.Process()
        backoff, last_beat = Backoff(max_s=self.max_backoff_s), 0.0
        try:
            self._retry(lambda: q.register_worker(self.engine, wid, pid=me.pid, host=self.host,
                                                  pid_started=me.create_time()),
                        "registering the worker")
            while not self.stopping.is_set():
                problem = self._runs_dir_problem()
                if problem:
                    self._pause(problem, backoff)
                    continue
                try:
                    eid = q.claim_next(self.engine, wid, host=self.host)
                except Exception as e:  # noqa: BLE001
                    if not is_transient(e):
                        raise
                    self.engine.dispose()  # connections from before the outage may be dead or read-only
                    self._store_seen(False)
                    self._pause(f"store unavailable ({short(e)})", backoff)
                    continue
                self._store_seen(True)
                self._resume(backoff)
                if eid is None:
                    if once or drain:
                        break
                    if time.monotonic() - last_beat >= self.heartbeat_s:
                        self._beat(wid, "idle")
                        last_beat = time.monotonic()
                    self.stopping.wait(self.poll_s)
                    continue
                last_beat = 0.0
                self.execute(eid, wid)
                if once:
                    break
        except Exception as e:  # noqa: BLE001 - retries are inside; what reaches here stops the worker
            if not (self.stopping.is_set() and is_transient(e)):
                self.fail(e)
        finally:
            self._beat(wid, "stopped")

    def _runs_dir_problem(self) -> str | None:
        """runs_dir_problem, probed at most every RUNS_DIR_CHECK_S while it is fine (a launch that fails on the
        host anyway re-queues its job and clears the cache)."""
        if time.monotonic() - self._runs_dir_ok_at < RUNS_DIR_CHECK_S:
            return None
        problem = recovery.runs_dir_problem(self.runs_dir, self.min_free_bytes)
        self._runs_dir_ok_at = 0.0 if problem else time.monotonic()
        return problem

    def _pause(self, why: str, backoff: Backoff) -> None:
        wait = backoff.wait_s()
        if why != self._paused_for or backoff.failures in (1, 5) or backoff.failures % 20 == 0:
            log.warning("not claiming jobs: %s; checking again in %.1f s", why, wait)
        self._paused_for = why
        self.stopping.wait(wait)

    def _resume(self, backoff: Backoff) -> None:
        if self._paused_for is not None:
            log.warning("claiming jobs again (was: %s)", self._paused_for)
            self._paused_for = None
        backoff.reset()

    def _beat(self, wid: str, state: str) -> None:
        """The worker row's state; a store outage only costs this heartbeat (logged), never the worker."""
        try:
            q.set_worker_state(self.engine, wid, state)
        except Exception as e:  # noqa: BLE001
            if not is_transient(e):
                if isinstance(e, StoreError) or not self.stopping.is_set():
                    self.fail(e)
                return
            log.warning("worker heartbeat skipped: store unavailable (%s)", short(e))


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
