"""A real run through the worker leaves no torchelastic folder behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from db import queries as q
from db.session import REPO, open_db
from tests.helpers.store_helpers import spec

PY = sys.executable


@pytest.mark.slow
def test_a_real_run_through_the_worker_leaves_no_torchelastic_folder(tmp_path):
    def elastic() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("torchelastic_*")}

    url = f"sqlite:///{tmp_path / 'store.db'}"
    eid = q.submit_experiment(open_db(url), spec("real"))
    before = elastic()
    done = subprocess.run([PY, "-m", "backend", "worker", "--db", url, "--once", "--runs-dir", str(tmp_path / "runs")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert q.get_status(open_db(url), eid) == "ok"
    assert elastic() - before == set()
    assert not list(Path(tempfile.gettempdir()).glob(f"shardlab-job-{eid}-*"))
