"""The store commands as a program: the database URL comes from SHARDLAB_DB_URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from db.session import REPO

FLAGS = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
         "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]


def test_db_url_comes_from_the_environment(store_urls, tmp_path):
    url = store_urls.url("env.db")
    env = {**os.environ, "SHARDLAB_DB_URL": url, "OMP_NUM_THREADS": "1"}
    sub = subprocess.run([sys.executable, "-m", "backend", "submit", *FLAGS], cwd=REPO, env=env, capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    listed = subprocess.run([sys.executable, "-m", "backend", "list", "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    assert [r["id"] for r in json.loads(listed.stdout)] == [int(sub.stdout)]
    assert store_urls.backend != "sqlite" or (tmp_path / "env.db").exists()
