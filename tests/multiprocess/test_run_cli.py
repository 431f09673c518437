"""`python -m backend run`: one JSON object or a readable table, progress on stderr, honest exit codes. The CLI runs
in-process (backend.cli.main) and launches the job's ranks; SIGTERM needs the CLI as a process of its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend.cli.run_summary import summary
from backend.result import RunResult
from tests.helpers.launch import assert_no_orphans, cli, rank_env
from tests.helpers.specs import tiny_spec

TINY_FLAGS = ["--strategy", "ddp", "--world", "2", "--steps", "2", "--warmup-steps", "1", "--layers", "2",
              "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--global-batch", "4",
              "--micro-batch", "2", "--timeout", "180"]


@pytest.mark.unit
def test_invalid_spec_exits_2_with_arithmetic_and_launches_nothing(tmp_path: Path) -> None:
    out = cli("run", "--strategy", "ddp", "--world", "3", "--global-batch", "4", "--micro-batch", "2",
              "--workdir", str(tmp_path / "run"), cwd=tmp_path)
    assert out.code == 2, out.err
    assert "global batch 4 is not divisible by micro-batch 2 * dp 3 = 6" in out.err
    assert out.out == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_flags_json_ok(tmp_path: Path) -> None:
    out = cli("run", *TINY_FLAGS, "--json", cwd=tmp_path)
    assert out.code == 0, out.err[-3000:]
    data = json.loads(out.out)  # exactly one JSON object
    assert data["status"] == "ok" and data["error"] is None
    assert data["spec"]["parallel"]["world_size"] == 2
    for r in data["per_rank"]:
        assert ({"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"}
                <= r["measured"].keys())
        assert r["measured"]["params_bytes"] > 0 and r["predicted"]["params_bytes"] > 0
        assert r["step_s"] and {"calls", "bytes", "seconds"} <= r["comm"]["all_reduce"].keys()
    assert data["tokens_per_s"] > 0 and data["loss"] and data["loss_reference"]
    assert data["loss_max_abs_diff"] is not None
    assert "step 1/2 (timed)" in out.err
    assert list((tmp_path / ".shardlab" / "runs").iterdir()) == []  # default run dir removed without --keep
    table = summary(RunResult.model_validate(data))
    assert "run ok: ddp world=2" in table and "measured" in table and "predicted" in table
    assert "tokens/s" in table and "loss parity" in table


@pytest.mark.slow
def test_spec_file_failed_run_exits_1_with_summary(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(tiny_spec(timeout_s=180).to_json())
    workdir = tmp_path / "run"
    out = cli("run", "--spec", str(spec_file), "--workdir", str(workdir), cwd=tmp_path,
              env={"SHARDLAB_FAULT": "raise:rank=1:step=0"})
    assert out.code == 1, out.err[-3000:]
    assert "run failed" in out.out and "injected fault on rank 1 at step 0" in out.out
    assert "failing rank 1" in out.out, out.out
    assert RunResult.from_json((workdir / "result.json").read_text()).status == "failed"


@pytest.mark.slow
def test_sigterm_cancels_the_job_without_orphans(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    env = rank_env({"SHARDLAB_FAULT": "hang:rank=0:step=2"})
    cmd = [sys.executable, "-m", "backend", "run", *TINY_FLAGS, "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # wait until the job really runs
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout
    assert "run cancelled" in stdout
    res = RunResult.from_json((workdir / "result.json").read_text())
    assert res.status == "cancelled"
    assert_no_orphans(res, res.env["launch"]["job_id"])
