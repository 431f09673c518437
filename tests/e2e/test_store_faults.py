"""Store faults on a real PostgreSQL server: a result finished during a restart is stored when it is back; an idle worker survives a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from backend.worker.service import Worker
from db import queries as q
from db.session import REPO, open_db
from tests.helpers.store_helpers import fake_result, spec
from tests.helpers.worker_helpers import FakeRunner, wait_for

PY = sys.executable


def _serve(worker: Worker, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("code", worker.serve(**kw)), daemon=True)
    t.start()
    return t, out


def start_worker(url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "0.5", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def stop(proc: subprocess.Popen, timeout: float = 30) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def fresh_heartbeat(engine, max_age_s: float = 2.0) -> bool:
    try:
        return any(w["age_s"] < max_age_s and w["state"] == "idle" for w in q.worker_heartbeats(engine))
    except Exception:  # noqa: BLE001 - the store may be down while we look
        return False


# ---- 2. a result on disk is the source of truth until it is stored ---------------------------------

def quick(worker: Worker) -> Worker:
    worker.max_backoff_s = 1.0  # retry every second at most: the test does not wait out a 30 s backoff
    return worker


@pytest.mark.postgres
@pytest.mark.slow
def test_a_result_finished_during_a_postgres_restart_is_stored_when_it_is_back(pg_server, tmp_path):
    url = pg_server.url(pg_server.new_database())
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("across a restart"))
    runner = FakeRunner(block=True)
    worker = quick(Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.1, heartbeat_s=0.5, runner=runner))
    t, out = _serve(worker, once=True)
    wait_for(lambda: q.get_status(engine, eid) == "running")
    pg_server.pause()
    try:
        runner.release.set()  # the run ends while the server is down
        time.sleep(9.5)  # longer than the 5 tries 2 s apart the worker used to make
        assert t.is_alive()
        assert json.loads((tmp_path / "runs" / str(eid) / "result.json").read_text())["status"] == "ok"
    finally:
        pg_server.resume()
    t.join(60)
    assert not t.is_alive() and out["code"] == 0
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok" and row["result"] == fake_result(spec("across a restart"))


# ---- 3. workers ride out store outages ---------------------------------------------------------------

@pytest.mark.postgres
def test_an_idle_worker_survives_a_postgres_restart(pg_server):
    url = pg_server.url(pg_server.new_database())
    engine = open_db(url)
    proc = start_worker(url, "--max-backoff-s", "1")
    try:
        wait_for(lambda: fresh_heartbeat(engine), timeout_s=60)
        pg_server.pause()
        time.sleep(5)
        assert proc.poll() is None, "the worker quit during the outage"
        pg_server.resume()
        time.sleep(1.5)
        wait_for(lambda: fresh_heartbeat(engine, 1.5), timeout_s=40)
        assert proc.poll() is None
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and "store unavailable" in out, out[-2000:]
