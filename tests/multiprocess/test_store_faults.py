"""Store faults met by a worker process: an immutable store file is waited out; a removed or replaced one stops it and is not re-created."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from backend.cli import main
from db import queries as q
from db.session import REPO, forget_engines, open_db
from backend.spec import ExperimentSpec
from tests.helpers.store_helpers import TINY
from tests.helpers.worker_helpers import wait_for

PY = sys.executable


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


@pytest.mark.slow
def test_an_immutable_store_file_is_waited_out(tmp_path):
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    url = f"sqlite:///{tmp_path / 'frozen.db'}"
    engine = open_db(url)
    # fails in the launcher's preflight (no CUDA here): the worker's run ends at once, no process is started
    eid = q.submit_experiment(engine, ExperimentSpec.model_validate(
        {**TINY, "name": "frozen", "runtime": {"device": "cuda", "backend": "nccl"}}))
    forget_engines()
    db_file = tmp_path / "frozen.db"
    if subprocess.run(["chattr", "+i", str(db_file)], capture_output=True).returncode != 0:
        pytest.skip("this file system does not take the immutable flag")
    try:
        proc = start_worker(url, "--once", "--runs-dir", str(tmp_path / "runs"), "--max-backoff-s", "1")
        time.sleep(6)
        assert proc.poll() is None, "the worker quit on an immutable store"
    finally:
        subprocess.run(["chattr", "-i", str(db_file)])
    try:
        out, _ = proc.communicate(timeout=120)  # --once: it runs the job once the file is writable, then exits
    finally:
        out = out if proc.poll() is not None else stop(proc)
    assert proc.returncode == 0 and "store unavailable" in out and "readonly" in out, out[-2000:]
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "failed" and "needs CUDA" in row["error"]


# ---- 4. the store file removed or replaced -----------------------------------------------------------

@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_removed_or_replaced_store_file_stops_the_worker_and_is_not_recreated(tmp_path, capsys, how):
    db_file = tmp_path / "store.db"
    url = f"sqlite:///{db_file}"
    open_db(url)
    forget_engines()
    proc = start_worker(url, "--runs-dir", str(tmp_path / "runs"))
    try:
        wait_for(lambda: fresh_heartbeat(open_db(url)), timeout_s=60)
        forget_engines()
        if how == "removed":
            db_file.unlink()
        else:
            shutil.copy(db_file, tmp_path / "copy.db")
            os.replace(tmp_path / "copy.db", db_file)
        proc.wait(timeout=60)
    finally:
        out = stop(proc)
    assert proc.returncode == 2, out[-3000:]
    assert f"the SQLite store {db_file} {'was removed' if how == 'removed' else 'was replaced'}" in out
    if how == "removed":
        assert main(["list", "--db", url]) == 2
        assert "is gone" in capsys.readouterr().err and not db_file.exists()
