"""Keep one background worker alive for the dashboard: start `python -m backend worker` when none beats.

A file lock next to the database serialises the check-then-start across Streamlit sessions and
processes, and a pid file remembers the worker we started so a worker that has not yet written its
first heartbeat is not started twice. `SHARDLAB_NO_WORKER=1` turns auto-start off (tests).

The worker the dashboard starts follows it (`--exit-with <dashboard pid>`, `follow_parent`): when the dashboard
exits, even by kill -9, the worker stops as on SIGTERM (a running job is ended and stored `interrupted`, so it can
be re-queued). A worker started by hand (`make worker`) runs until it is stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_FRESH_S = 30.0


@dataclass
class WorkerStatus:
    alive: bool
    detail: str
    started_now: bool = False


def _state_dir(url: str) -> Path:
    d = Path(tempfile.gettempdir()) / "shardlab-ui" / hashlib.sha1(url.encode()).hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    return d


def heartbeats(engine) -> list[dict]:
    """Worker rows newest first (id, pid, host, state, experiment_id, heartbeat_at, age_s, alive)."""
    from db.workers import worker_heartbeats

    try:
        return worker_heartbeats(engine, stale_after_s=HEARTBEAT_FRESH_S)
    except Exception:  # noqa: BLE001 - a store without the workers table just has no live worker
        return []


def live(engine) -> list[dict]:
    return [w for w in heartbeats(engine) if w.get("alive")]


def _pid_alive(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE and "backend" in " ".join(p.cmdline()) and "worker" in " ".join(p.cmdline()):
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def ensure_worker(engine, url: str) -> WorkerStatus:
    """Start a worker if no live heartbeat and no worker we started is alive."""
    if os.environ.get("SHARDLAB_NO_WORKER") == "1":
        ws = live(engine)
        return WorkerStatus(bool(ws), (describe(ws) if ws else "0 alive") + " (auto-start off: SHARDLAB_NO_WORKER=1)")
    d = _state_dir(url)
    with open(d / "worker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ours = _pid_alive(d / "worker.pid")
        ws = live(engine)
        if ws:
            return WorkerStatus(True, describe(ws) + (OURS if ours in {w["pid"] for w in ws} else ""))
        if ours:
            return WorkerStatus(True, f"worker pid {ours} starting{OURS}")
        pid = _spawn(url, d / "worker.log")
        (d / "worker.pid").write_text(str(pid))
        return WorkerStatus(True, f"started worker pid {pid} (log {d / 'worker.log'}){OURS}", started_now=True)


OURS = "; started by this dashboard: it stops when the dashboard stops (a running job is stored as interrupted)"


def describe(workers: list[dict]) -> str:
    """'pid 12 running #7, pid 13 idle' from heartbeat rows."""
    return ", ".join(f"pid {w['pid']} {w['state']}" + (f" #{w['experiment_id']}" if w.get("state") == "running"
                                                         and w.get("experiment_id") else "") for w in workers)


def _spawn(url: str, log: Path) -> int:
    env = dict(os.environ, SHARDLAB_DB_URL=url, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "backend", "worker", "--exit-with", str(os.getpid())], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid


def follow_parent(pid: int, stop: Callable[[], None], every_s: float = 1.0) -> threading.Thread:
    """A daemon thread that calls `stop()` once process `pid` is gone (or was never there); a new process that
    reuses the pid does not count (its start time differs)."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None

    def alive() -> bool:
        try:
            p = psutil.Process(pid)
            return started is not None and p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            threading.Event().wait(every_s)
        stop()

    t = threading.Thread(target=watch, name=f"follow-{pid}", daemon=True)
    t.start()
    return t
