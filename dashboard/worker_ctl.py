"""Keep one background worker alive for the dashboard: start `python -m backend worker` when none beats.

A file lock next to the database serialises the check-then-start across Streamlit sessions and
processes, and a pid file remembers the worker we started so a worker that has not yet written its
first heartbeat is not started twice. `SHARDLAB_NO_WORKER=1` turns auto-start off (tests).

The worker the dashboard starts follows it (`--exit-with <dashboard pid>`, backend/worker/lifetime.follow_parent):
when the dashboard exits, even by kill -9, the worker stops as on SIGTERM (a running job is ended and stored
`interrupted`, so it can be re-queued). A worker started by hand (`make worker`) runs until it is stopped.

The lock, pid and log files live in a private folder (`state_dir`): $XDG_RUNTIME_DIR (or the temp folder)
/shardlab-ui-<uid>/<hash of the store URL>, each level created 0700 and checked to be a real folder of this user
that no one else can write, and every file is opened with O_NOFOLLOW. On a shared host another user could otherwise
plant a symlink there and make the dashboard, which checks its worker on every page, overwrite any file of this
user with a pid (issue 31).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_FRESH_S = 30.0


@dataclass
class WorkerStatus:
    alive: bool
    detail: str
    started_now: bool = False


class UnsafeStateDir(RuntimeError):
    """The dashboard's state folder is not private to this user: nothing is read or written in it."""


def state_dir(url: str) -> Path:
    """This store's private state folder (module docstring), created or checked on each call."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    base = root / f"shardlab-ui-{os.geteuid()}"
    d = base / hashlib.sha1(url.encode()).hexdigest()[:12]
    for level in (base, d):
        _private_dir(level)
    return d


def _private_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    why = ("is a symlink" if stat.S_ISLNK(info.st_mode) else "is not a folder" if not stat.S_ISDIR(info.st_mode)
           else f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})" if info.st_uid != os.geteuid()
           else f"has mode {stat.S_IMODE(info.st_mode):o}: others may write or read it" if info.st_mode & 0o077
           else None)
    if why:
        raise UnsafeStateDir(f"the dashboard's state folder {path} {why}; it must be a private folder (mode 700) of "
                             "this user. Remove it (another user may have planted it), then reload the page.")


def _open(path: Path, flags: int) -> int:
    """A file descriptor of `path`, never through a symlink; created 0600."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeStateDir(f"{path} is a symlink: the dashboard neither reads nor writes through it. Remove it "
                                 "(another user may have planted it), then reload the page.") from None
        raise


def _read_pid(path: Path) -> str:
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd) as f:
        return f.read(64)


def _write_pid(path: Path, pid: int) -> None:
    with os.fdopen(_open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        f.write(str(pid))


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
    text = _read_pid(pid_file)  # a planted symlink raises here, before any worker is started
    try:
        pid = int(text.strip())
        p = psutil.Process(pid)
        if (p.status() != psutil.STATUS_ZOMBIE and "backend" in " ".join(p.cmdline())
                and "worker" in " ".join(p.cmdline())):
            return pid
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def ensure_worker(engine, url: str) -> WorkerStatus:
    """Start a worker if no live heartbeat and no worker we started is alive."""
    if os.environ.get("SHARDLAB_NO_WORKER") == "1":
        ws = live(engine)
        return WorkerStatus(bool(ws), (describe(ws) if ws else "0 alive") + " (auto-start off: SHARDLAB_NO_WORKER=1)")
    d = state_dir(url)
    with os.fdopen(_open(d / "worker.lock", os.O_RDWR | os.O_CREAT), "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ours = _pid_alive(d / "worker.pid")
        ws = live(engine)
        if ws:
            return WorkerStatus(True, describe(ws) + (OURS if ours in {w["pid"] for w in ws} else ""))
        if ours:
            return WorkerStatus(True, f"worker pid {ours} starting{OURS}")
        pid = _spawn(url, d / "worker.log")
        _write_pid(d / "worker.pid", pid)
        return WorkerStatus(True, f"started worker pid {pid} (log {d / 'worker.log'}){OURS}", started_now=True)


OURS = "; started by this dashboard: it stops when the dashboard stops (a running job is stored as interrupted)"


def describe(workers: list[dict]) -> str:
    """'pid 12 running #7, pid 13 idle' from heartbeat rows."""
    return ", ".join(f"pid {w['pid']} {w['state']}" + (f" #{w['experiment_id']}" if w.get("state") == "running"
                                                         and w.get("experiment_id") else "") for w in workers)


def _spawn(url: str, log: Path) -> int:
    env = dict(os.environ, SHARDLAB_DB_URL=url, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with os.fdopen(_open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "backend", "worker", "--exit-with", str(os.getpid())], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid
