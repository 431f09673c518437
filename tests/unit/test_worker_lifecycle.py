"""The worker the dashboard starts stops with the dashboard (issue 20 item 8), and the sidebar shows the worker's
state as it is, not as it was (item 9)."""

from __future__ import annotations

import os
from pathlib import Path

from streamlit.testing.v1 import AppTest

from dashboard import worker_ctl
from db import queries as q
from db.session import open_db

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
