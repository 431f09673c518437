import os
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The dashboard starts a worker when none is alive; in tests that worker would outlive the session.
os.environ.setdefault("SHARDLAB_NO_WORKER", "1")
# Every process the suite starts inherits this tag, so strays can be found (and only ours).
SESSION_TAG = os.environ.setdefault("SHARDLAB_TEST_SESSION", uuid.uuid4().hex)


def _stray_workers() -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if p.pid != os.getpid() and "backend" in cmd and "worker" in cmd \
                    and p.environ().get("SHARDLAB_TEST_SESSION") == SESSION_TAG and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    """No `python -m backend worker` started by this test session may outlive it: kill strays and fail."""
    import psutil

    strays = _stray_workers()
    if not strays:
        return
    lines = []
    for p in strays:
        try:
            lines.append(f"pid {p.pid}: {' '.join(p.cmdline())} (db {p.environ().get('SHARDLAB_DB_URL')})")
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(strays, timeout=5)
    sys.stderr.write("\nstray worker process(es) left by the test session (killed):\n  " + "\n  ".join(lines) + "\n")
    session.exitstatus = 1
