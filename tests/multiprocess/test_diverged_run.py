"""Issue 31 item 2 with the issue's own steps: an fp16-mixed run at lr 10 diverges on real ranks; the worker stores it
ok with its NaN losses, `show` and `list` mark it diverged, and the JSON export carries the losses as standard JSON.
Before the fix `show 1` exited 1 with pydantic's "loss.1 Input should be a valid number". The store commands run
in-process (backend.cli.main), the worker as the process it is."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.launch import cli, cli_process

ISSUE_STEPS = ["--strategy", "ddp", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
               "--world", "2", "--steps", "10", "--lr", "10", "--precision", "fp16-mixed"]


def strict(text: str):
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))


@pytest.mark.slow
def test_the_issues_fp16_lr10_run_is_stored_shown_and_exported(tmp_path):
    db = f"sqlite:///{tmp_path / 'o.db'}"
    env = {"SHARDLAB_DB_URL": db}
    assert cli("submit", *ISSUE_STEPS, env=env).out.strip() == "1"
    worker = cli_process("worker", "--once", "--runs-dir", str(tmp_path / "runs"), env=env, timeout_s=400)
    assert worker.returncode == 0 and "experiment 1: ok" in worker.stderr, worker.stderr[-2000:]
    shown = cli("show", "1", env=env)
    assert shown.code == 0, shown.err[-2000:]
    assert re.search(r"diverged: yes: the loss is (nan|inf|-inf) from step \d+ of 11 on", shown.out), shown.out
    assert " 1 ok diverged ddp " in cli("list", env=env).out
    data = strict(cli("show", "1", "--json", env=env).out)
    assert data["diverged"] is True and {"NaN", "Infinity", "-Infinity"} & set(data["result"]["loss"])
    assert any(n.startswith("DIVERGED: the loss is") for n in data["result"]["notes"])
    exported = strict(cli("export", "--format", "json", env=env).out)
    assert exported[0]["result"]["loss"] == data["result"]["loss"]
    on_disk = strict((tmp_path / "runs" / "1" / "result.json").read_text())
    assert on_disk["loss"] == data["result"]["loss"]
