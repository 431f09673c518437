"""The worker on real runs: a full runs folder pauses it without burning a job, then the job runs once there is
space; a real run through it leaves no torchelastic folder behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.worker.service import Worker
from db import queries as q
from db.session import REPO, forget_engines, open_db
from tests.helpers.store_helpers import SmallFs, spec
from tests.helpers.worker_helpers import wait_for

PY = sys.executable


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFs(tmp_path / "small", "8m")
    reason = fs.mount()
    if reason:
        pytest.skip(reason)
    yield fs
    forget_engines()
    fs.unmount()


def test_a_full_runs_folder_pauses_the_worker_and_burns_no_job(small_fs, tmp_path, caplog):
    engine = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    ids = q.submit_experiments(engine, [spec(str(i)) for i in range(4)])
    small_fs.fill()
    worker = Worker(engine, runs_dir=small_fs.path / "runs", poll_s=0.05)  # the real launcher
    worker.min_free_bytes, worker.max_backoff_s = 1 << 20, 0.5
    caplog.set_level(logging.WARNING, logger="shardlab.worker")
    t = threading.Thread(target=worker.serve, daemon=True)
    t.start()
    try:
        time.sleep(3)
        assert [q.get_status(engine, i) for i in ids] == ["queued"] * 4
        assert "No space left on device" in caplog.text or "MiB free" in caplog.text
        assert not list(small_fs.path.rglob("*.tmp")) and not list(small_fs.path.rglob(".*.tmp"))
        small_fs.free()
        wait_for(lambda: q.get_status(engine, ids[0]) != "queued", timeout_s=30)
    finally:
        small_fs.free()
        worker.stop()
        t.join(60)
    assert [q.get_status(engine, i) for i in ids[1:]] == ["queued"] * 3
    assert q.get_status(engine, ids[0]) in ("interrupted", "ok")
    assert "claiming jobs again" in caplog.text


@pytest.mark.slow
def test_a_real_run_through_the_worker_leaves_no_torchelastic_folder(tmp_path):
    # The worker's own temp root: other tests' killed workers leave shardlab-job-1-* in the shared one for gc.
    worker_tmp = tmp_path / "tmp"
    worker_tmp.mkdir()

    def elastic() -> set[str]:
        return {p.name for p in worker_tmp.glob("torchelastic_*")}

    url = f"sqlite:///{tmp_path / 'store.db'}"
    eid = q.submit_experiment(open_db(url), spec("real"))
    before = elastic()
    done = subprocess.run([PY, "-m", "backend", "worker", "--db", url, "--once", "--runs-dir", str(tmp_path / "runs")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(worker_tmp)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert q.get_status(open_db(url), eid) == "ok"
    assert elastic() - before == set()
    assert not list(worker_tmp.glob(f"shardlab-job-{eid}-*"))
