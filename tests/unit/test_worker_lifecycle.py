"""The worker the dashboard starts stops with the dashboard (issue 20 item 8), and the sidebar shows the worker's
state as it is, not as it was (item 9). A worker process (multiprocess) follows the process it was told to: when
that exits, even mid-run, it stops and stores the run interrupted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import worker_ctl
from db import queries as q
from db.session import REPO, open_db

APP = str(Path(__file__).resolve().parents[2] / "app.py")


def test_the_dashboard_starts_its_worker_tied_to_itself(tmp_path, monkeypatch):
    started = []

    class Popen:
        def __init__(self, argv, **kw):
            started.append(argv)
            self.pid = 4242

    monkeypatch.setattr(worker_ctl.subprocess, "Popen", Popen)
    assert worker_ctl._spawn("sqlite:///x.db", tmp_path / "w.log") == 4242
    assert started[0][-2:] == ["--exit-with", str(os.getpid())]


def test_sidebar_shows_the_worker_state_of_now(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    engine = open_db(url)
    from tests.helpers.store_helpers import spec

    eid = q.submit_experiment(engine, spec())
    q.register_worker(engine, "h:1:0", pid=os.getpid(), host="h", pid_started=None)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert any("pid" in s.value and "idle" in s.value for s in at.sidebar.success)
    q.set_worker_state(engine, "h:1:0", "running", eid)
    at.run()
    assert any(f"running #{eid}" in s.value for s in at.sidebar.success), [s.value for s in at.sidebar.success]


# ---- in processes of their own ----------------------------------------------------------------------------

def _wait(predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {predicate}")


def _worker(url: str, parent: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2",
                             "--heartbeat-s", "1", "--exit-with", str(parent)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
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
