"""Issue 31 item 2 with the issue's own steps: an fp16-mixed run at lr 10 diverges on real ranks; the worker stores it
ok with its NaN losses, `show` and `list` mark it diverged, and the JSON export carries the losses as standard JSON.
Before the fix `show 1` exited 1 with pydantic's "loss.1 Input should be a valid number"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ISSUE_STEPS = ["--strategy", "ddp", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
               "--world", "2", "--steps", "10", "--lr", "10", "--precision", "fp16-mixed"]


def cli(*args: str, db: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDLAB_DB_URL": db, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)


def strict(text: str):
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))


@pytest.mark.slow
def test_the_issues_fp16_lr10_run_is_stored_shown_and_exported(tmp_path):
    db = f"sqlite:///{tmp_path / 'o.db'}"
    assert cli("submit", *ISSUE_STEPS, db=db).stdout.strip() == "1"
    worker = cli("worker", "--once", "--runs-dir", str(tmp_path / "runs"), db=db)
    assert worker.returncode == 0 and "experiment 1: ok" in worker.stderr, worker.stderr[-2000:]
    shown = cli("show", "1", db=db)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert re.search(r"diverged: yes: the loss is (nan|inf|-inf) from step \d+ of 11 on", shown.stdout), shown.stdout
    assert " 1 ok diverged ddp " in cli("list", db=db).stdout
    data = strict(cli("show", "1", "--json", db=db).stdout)
    assert data["diverged"] is True and {"NaN", "Infinity", "-Infinity"} & set(data["result"]["loss"])
    assert any(n.startswith("DIVERGED: the loss is") for n in data["result"]["notes"])
    exported = strict(cli("export", "--format", "json", db=db).stdout)
    assert exported[0]["result"]["loss"] == data["result"]["loss"]
    on_disk = strict((tmp_path / "runs" / "1" / "result.json").read_text())
    assert on_disk["loss"] == data["result"]["loss"]
