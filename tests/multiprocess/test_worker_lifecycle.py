"""The worker the dashboard starts follows it: when the process it follows exits, even mid-run, it stops and stores the run interrupted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from db import queries as q
from db.session import REPO, open_db


def _wait(predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {predicate}")


def _worker(url: str, parent: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "1",
                             "--exit-with", str(parent)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_worker_stops_when_the_process_it_follows_exits(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    engine = open_db(url)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    worker = _worker(url, parent.pid)
    try:
        _wait(lambda: any(w["state"] == "idle" for w in q.worker_heartbeats(engine)))
        assert worker.poll() is None
        parent.kill()
        parent.wait()
        assert worker.wait(15) == 0, worker.stdout.read()
        assert {w["state"] for w in q.worker_heartbeats(engine)} == {"stopped"}
    finally:
        for p in (parent, worker):
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_a_run_in_progress_is_stored_interrupted_when_the_dashboard_goes(tmp_path):
    from tests.helpers.store_helpers import spec

    url = f"sqlite:///{tmp_path / 'f.db'}"
    engine = open_db(url)
    s = spec("long", world_size=2).model_copy(deep=True)
    s.train.steps = 10_000  # runs until stopped
    eid = q.submit_experiment(engine, s)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    worker = _worker(url, parent.pid)
    try:
        _wait(lambda: (q.get_experiment(engine, eid)["progress_step"] or 0) >= 1, 120)
        parent.kill()
        parent.wait()
        assert worker.wait(60) == 0
        row = q.get_experiment(engine, eid)
        assert row["status"] == "interrupted" and row["error"].startswith("worker stopped"), row["error"]
    finally:
        for p in (parent, worker):
            if p.poll() is None:
                p.kill()
