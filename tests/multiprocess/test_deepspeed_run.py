"""DeepSpeed ZeRO runs at world 2 on gloo: loss parity with the single-process torch reference (fp32 ≤ 1e-4), model
states within 2% of backend/analytic/frameworks/deepspeed_layout.py, DeepSpeed's own estimate beside it, and the
ds_config kept with the run. One run end to end through the CLI (in-process) and the launcher, one through the
dashboard's submit and a worker process; every stage and offload as farm jobs (DeepSpeed's rank program)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.result import RunResult
from backend.spec import ExperimentSpec
from tests.helpers.farm import engine_job, uses
from tests.helpers.launch import cli, rank_env

pytest.importorskip("deepspeed")
FLAGS = ["--framework", "deepspeed", "--world", "2", "--steps", "2", "--warmup-steps", "1", "--layers", "2",
         "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--global-batch", "4", "--micro-batch", "1",
         "--timeout", "400"]


def _spec(strategy: str, offload: str = "none") -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "framework": "deepspeed", "name": f"ds_{strategy}_{offload}",
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 1, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": strategy, "world_size": 2, "offload": offload},
        "runtime": {"device": "cpu", "timeout_s": 400},
    })


def check(result: RunResult) -> None:
    assert result.status == "ok", (result.error, (result.log_tail or "")[-3000:])
    assert result.loss_max_abs_diff is not None and result.loss_max_abs_diff <= 1e-4
    assert len(result.per_rank) == 2
    for rr in result.per_rank:
        m, p = rr.model_states_measured, rr.model_states_predicted
        assert m.total_bytes > 0 and abs(m.total_bytes - p.total_bytes) <= 0.02 * p.total_bytes, (m, p)
        assert rr.measured.params_bytes > 0 and rr.measured.optimizer_bytes > 0
        assert rr.comm and sum(c.bytes for c in rr.comm.values()) > 0  # DeepSpeed's collectives, seen at the dispatcher
        assert rr.step_s and all(s > 0 for s in rr.step_s)
    facts = result.framework_facts
    assert facts["framework"] == "deepspeed" and facts["ds_config"]["zero_optimization"]["stage"] in (0, 1, 2, 3)
    if facts["ds_config"]["zero_optimization"]["stage"]:
        est = result.per_rank[0].framework_estimate
        assert est is not None and est.device_bytes > 0 and "DeepSpeed" in est.source


@pytest.mark.serial
def test_cli_zero2_offload_json(tmp_path: Path) -> None:
    """The default suite's one DeepSpeed end-to-end run: ZeRO-2 with optimizer offload from the CLI."""
    out = cli("run", *FLAGS, "--strategy", "zero2", "--offload", "optimizer", "--json", "--keep", "--workdir",
              str(tmp_path / "run"), cwd=tmp_path)
    assert out.code == 0, out.err[-3000:]
    result = RunResult.model_validate(json.loads(out.out))
    check(result)
    cfg = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert result.framework_facts["ds_config"] == cfg


STAGES = {(strategy, offload): engine_job(_spec(strategy, offload))
          for strategy, offload in [("ddp", "none"), ("zero1", "none"), ("zero2", "none"), ("zero3", "none"),
                                    ("zero3", "optimizer")]}


@pytest.mark.slow
@pytest.mark.parametrize("strategy, offload", [pytest.param(*case, marks=uses(job)) for case, job in STAGES.items()])
def test_stages_and_offload(farm, strategy: str, offload: str) -> None:
    check(farm.result(STAGES[strategy, offload])["result"])


@pytest.mark.slow
def test_dashboard_submit_then_worker_runs_zero3_offload(tmp_path: Path, monkeypatch) -> None:
    """The dashboard's submit (dashboard.store_access.submit), then a worker: the stored run is DeepSpeed's, with the
    framework column set and DeepSpeed's estimate inside the stored result."""
    from dashboard import store_access
    from db import queries as q
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    eid = store_access.submit(_spec("zero3", "optimizer"), tags=("i14",))
    run = subprocess.run([sys.executable, "-m", "backend", "worker", "--db", url, "--once"], cwd=tmp_path,
                         env=rank_env({"SHARDLAB_DB_URL": url}), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "ok" and row["framework"] == "deepspeed", (row["error"], row["log_tail"])
    check(row["result"])
