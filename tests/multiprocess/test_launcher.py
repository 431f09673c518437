"""The launcher's process handling on real processes: ending a job ends workers in their own sessions, a dead launcher takes its job down."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from backend.launch import torchrun


SPAWNER = """
import subprocess, sys, time
# like torchrun: a worker in its own session, so killing our process group alone would miss it
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("started", flush=True)
time.sleep(120)
"""


def test_terminate_ends_workers_in_their_own_sessions(tmp_path: Path) -> None:
    from backend.launch.procs import Job, job_processes

    env, job_id = torchrun.build_env()
    job = Job([sys.executable, "-c", SPAWNER], env=env, cwd=tmp_path, job_id=job_id, log_path=tmp_path / "log.txt")
    deadline = time.monotonic() + 60
    while len(job_processes(job_id)) < 2 and time.monotonic() < deadline:
        job.poll()
        time.sleep(0.1)
    assert len(job_processes(job_id)) == 2
    job.terminate(grace_s=5)
    job.close()
    assert job.proc.returncode == -15  # torchrun's real status: psutil must not reap it behind Popen's back
    assert job_processes(job_id, job.pgid) == []
    assert "started" in job.tail()


FORWARDER = """
import signal, subprocess, sys, time
# like torchrun: the SIGTERM handler is in place before any worker starts; on SIGTERM, end the worker
# (in its own session) and exit. The death signal can come more than once (the kernel sends it again each time
# the orphan is re-parented, e.g. from the launcher's main thread to its log-reader thread and then to init); a
# re-entered handler would deadlock on Popen's waitpid lock, so later ones are ignored.
child = None
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if child is not None:
        child.terminate(); child.wait()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("ready", flush=True)
time.sleep(120)
"""

LAUNCHER = """
import sys, time
from pathlib import Path
from backend.launch import torchrun
from backend.launch.procs import Job
env, job_id = torchrun.build_env({torchrun.JOB_ENV: sys.argv[1]})
Job([sys.executable, "-c", sys.argv[2]], env=env, cwd=Path("."), job_id=job_id, log_path=Path(sys.argv[3]))
time.sleep(120)
"""


def test_launcher_death_ends_the_job(tmp_path: Path) -> None:
    """SIGKILL of the launcher itself: torchrun gets SIGTERM (PR_SET_PDEATHSIG) and ends its workers."""
    import os
    import signal
    import subprocess
    import uuid

    from backend.launch.procs import job_processes

    job_id = f"test-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "PYTHONPATH": str(torchrun.ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, job_id, FORWARDER, str(tmp_path / "log.txt")], env=env)
    try:
        log = tmp_path / "log.txt"
        deadline = time.monotonic() + 60
        # "ready": the worker has started and its handle is set (a SIGTERM in between would leave it behind,
        # a window that torchrun does not have and that this test is not about)
        while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(job_processes(job_id)) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while job_processes(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_processes(job_id)
        assert left == [], f"left behind: {_describe(left)}"
    finally:
        launcher.kill()
        for p in job_processes(job_id):
            p.kill()


def _describe(procs: list) -> list[str]:
    import psutil

    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ppid {p.ppid()} {p.status()} {' '.join(p.cmdline())[-60:]!r}")
        except psutil.Error as e:
            out.append(f"pid {p.pid}: {e}")
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_child_of_an_already_dead_launcher_ends_itself() -> None:
    """The launcher may die between fork and prctl: the death signal would never come, so the child checks."""
    import functools
    import os
    import subprocess

    from backend.launch.procs import _die_with_launcher

    def start(launcher_pid: int) -> int:
        return subprocess.run([sys.executable, "-c", "pass"], timeout=60,
                              preexec_fn=functools.partial(_die_with_launcher, launcher_pid)).returncode

    assert start(os.getpid()) == 0
    assert start(os.getpid() + 1_000_000) == 128 + 15  # not our parent: as if the launcher were gone
