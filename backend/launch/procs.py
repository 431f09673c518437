"""One torchrun job as an OS process tree: start it, stream its output, and end every process of it.

torchrun starts each worker with `start_new_session=True`, so killing torchrun's process group alone
would leave the ranks running. Every process of a job therefore carries the environment tag
`SHARDLAB_JOB_ID`; the job is ended by signalling torchrun's group, every descendant seen while it
ran, and every live process carrying the tag (which also finds ranks re-parented after torchrun died).
If the launcher itself is killed, torchrun gets SIGTERM from PR_SET_PDEATHSIG — possibly more than once: the
kernel re-sends it on every re-parenting (the launcher's forking thread -> another of its threads -> init).
torchrun retries its shutdown when a second one interrupts it; a worker that starts later kills what is left
(backend/worker/service.py kill_orphans).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from backend.launch.torchrun import JOB_ENV
from backend.runtime.protocol import STACK_SIGNAL

TAIL_LINES = 200
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if os.name == "posix" else None


def _die_with_launcher(launcher_pid: int) -> None:
    """In the forked child: SIGTERM torchrun if the launcher dies, so torchrun ends its ranks (Linux only).

    The death signal only covers a parent that dies after prctl; one that died between fork and prctl
    has already re-parented this child, so it ends itself before exec."""
    if _LIBC is not None and hasattr(_LIBC, "prctl"):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher_pid:
            os._exit(128 + signal.SIGTERM)


def job_processes(job_id: str, pgid: int | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes tagged with job_id, or in process group / session pgid."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            in_group = pgid is not None and (os.getpgid(p.pid) == pgid or os.getsid(p.pid) == pgid)
            if in_group or p.environ().get(JOB_ENV) == job_id:
                found.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


class Job:
    """A started torchrun process tree whose merged stdout+stderr is read line by line on a thread."""

    def __init__(self, cmd: list[str], *, env: dict[str, str], cwd: Path, job_id: str, log_path: Path,
                 on_line: Callable[[str], None] | None = None):
        self.job_id = job_id
        self._on_line = on_line
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self._seen: dict[int, psutil.Process] = {}
        self._log_error: str | None = None
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the reader thread
        try:
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=functools.partial(_die_with_launcher, os.getpid()) if sys.platform == "linux" else None,
            )
        except OSError:
            self._log.close()
            raise
        self.pgid = self.proc.pid  # start_new_session: torchrun leads its own session and group
        self._reader = threading.Thread(target=self._read, name=f"log-{job_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                with self._lock:
                    self._tail.append(line)
                    self._write_log(line)
                if self._on_line is not None:
                    try:
                        self._on_line(line)
                    except Exception:  # a broken progress callback must not stop the log
                        pass
        finally:
            with self._lock:
                try:
                    self._log.close()
                except OSError:
                    pass

    def _write_log(self, line: str) -> None:
        """Append to log.txt; a full or failing disk stops the file (said once in the tail), never the reader:
        torchrun's pipe must keep draining, or the ranks block writing their output."""
        if self._log.closed:
            return
        try:
            self._log.write(line + "\n")
            self._log.flush()
        except OSError as e:
            self._log_error = f"[shardlab] log.txt stopped at line {len(self._tail)} of the tail's window: {e}"
            try:
                self._log.close()
            except OSError:
                pass

    def tail(self) -> str:
        with self._lock:
            return "\n".join([*self._tail, *([self._log_error] if self._log_error else [])])

    def poll(self) -> int | None:
        self._remember_descendants()
        return self.proc.poll()

    def _remember_descendants(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def _members(self) -> list[psutil.Process]:
        """Every live process of the job except torchrun itself, which only Popen may reap
        (psutil reaping it would make Popen report exit code 0)."""
        members = {p.pid: p for p in self._seen.values() if p.is_running()}
        members.update({p.pid: p for p in job_processes(self.job_id, self.pgid)})
        members.pop(self.proc.pid, None)
        return list(members.values())

    def terminate(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole job, SIGKILL whatever is left after grace_s, and reap torchrun."""
        self._remember_descendants()
        members = self._members()
        self._signal_group(signal.SIGTERM)
        for p in members:
            _send(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        _, alive = psutil.wait_procs(members, timeout=grace_s)
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        for p in alive + self._members():
            _send(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def dump_stacks(self, marker: str, wait_s: float = 1.0) -> None:
        """SIGUSR1 to the job's rank processes (command line containing `marker`), which dump their Python
        stacks (backend/runtime/protocol.py); other processes would die of it, so only the marked ones."""
        sent = False
        for p in self._members():
            try:
                if marker in " ".join(p.cmdline()):
                    _send(p, STACK_SIGNAL)
                    sent = True
            except psutil.Error:
                continue
        if sent:
            time.sleep(wait_s)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc.poll() is not None:  # reaped: its group id may belong to someone else now
            return
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, timeout_s: float = 5.0) -> None:
        """After the job ended: make sure nothing of it survives, then drain the log reader."""
        if self._members():
            self.terminate(grace_s=1.0)
        self._reader.join(timeout=timeout_s)


def log_tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = 1 << 20) -> str | None:
    """The last `lines` lines of a job's log.txt, the window `Job.tail()` keeps while the job runs, for a job whose
    launcher is gone (its worker killed with kill -9); None when there is no log. Reads at most the last max_bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            data = f.read()
    except OSError:
        return None
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:]) or None


def _send(p: psutil.Process, sig: signal.Signals) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass
