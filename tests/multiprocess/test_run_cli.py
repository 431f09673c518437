"""`python -m backend run`: one JSON object or a readable table, progress on stderr, honest exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend.cli.run_summary import summary
from backend.result import RunResult
from tests.helpers.launch_helpers import assert_no_orphans, real_engine, tiny_spec

ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--strategy", "ddp", "--world", "2", "--steps", "2", "--warmup-steps", "1", "--layers", "2",
              "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--global-batch", "4",
              "--micro-batch", "2", "--timeout", "180"]


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "backend", "run", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=400)


def test_invalid_spec_exits_2_with_arithmetic_and_launches_nothing(tmp_path: Path) -> None:
    out = _cli(["--strategy", "ddp", "--world", "3", "--global-batch", "4", "--micro-batch", "2",
                "--workdir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 2, out.stderr
    assert "global batch 4 is not divisible by micro-batch 2 * dp 3 = 6" in out.stderr
    assert out.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(not real_engine(), reason="needs backend.engine (the real in-rank engine)")
def test_flags_json_ok(tmp_path: Path) -> None:
    out = _cli([*TINY_FLAGS, "--json"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)  # exactly one JSON object
    assert data["status"] == "ok" and data["error"] is None
    assert data["spec"]["parallel"]["world_size"] == 2
    for r in data["per_rank"]:
        assert {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"} <= r["measured"].keys()
        assert r["measured"]["params_bytes"] > 0 and r["predicted"]["params_bytes"] > 0
        assert r["step_s"] and {"calls", "bytes", "seconds"} <= r["comm"]["all_reduce"].keys()
    assert data["tokens_per_s"] > 0 and data["loss"] and data["loss_reference"]
    assert data["loss_max_abs_diff"] is not None
    assert "step 1/2 (timed)" in out.stderr
    assert list((tmp_path / ".shardlab" / "runs").iterdir()) == []  # default run dir removed without --keep
    table = summary(RunResult.model_validate(data))
    assert "run ok: ddp world=2" in table and "measured" in table and "predicted" in table
    assert "tokens/s" in table and "loss parity" in table


@pytest.mark.slow
def test_spec_file_failed_run_exits_1_with_summary(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(tiny_spec(timeout_s=180).to_json())
    workdir = tmp_path / "run"
    if real_engine():
        out = _cli(["--spec", str(spec_file), "--workdir", str(workdir)], tmp_path, SHARDLAB_FAULT="raise:rank=1:step=0")
    else:
        pytest.skip("needs backend.engine (the real in-rank engine)")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "run failed" in out.stdout and "injected fault on rank 1 at step 0" in out.stdout
    assert "failing rank 1" in out.stdout, out.stdout
    assert RunResult.from_json((workdir / "result.json").read_text()).status == "failed"


@pytest.mark.slow
def test_sigterm_cancels_the_job_without_orphans(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SHARDLAB_FAULT": "hang:rank=0:step=2"}
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
