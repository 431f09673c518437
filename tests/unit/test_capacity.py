"""The host capacity check for LOCAL runs (issue 20 item 2, issue 21 item 6): predicted host memory of all ranks
against the available RAM, ranks against cores; applied by `run`, `submit`, the worker and New experiment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.analytic.units import GiB
from backend.cli import main
from backend.launch import capacity
from backend.presets import preset_model
from backend.result import RunResult, Status
from backend.spec import validate_spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
HOST = capacity.Host(cores=2, available_bytes=int(20 * GiB))


def _spec(model: dict | None = None, **parallel):
    spec, problems = validate_spec({"model": model or {}, "parallel": {"strategy": "ddp", "world_size": 2, **parallel}})
    assert not problems, problems
    return spec


def test_llama7b_ddp_world2_is_refused_with_the_arithmetic():
    verdict = capacity.check(_spec(preset_model("llama-2-7b")), HOST, capacity.Limits())
    assert not verdict.ok
    text = verdict.refusal()
    # 2 ranks x (fp32 params + grads + Adam m, v = 16 B/param of 6.74B, plus activations) + 2 x 0.31 GiB runtime
    assert "2 ranks need" in text and "16.00 GiB usable (20.00 GiB available - 20% headroom)" in text
    assert verdict.need_bytes > 2 * 16 * 6.7e9
    assert "Run it here" in text and "Trace at full size" in text


def test_ranks_against_cores_warn_then_refuse_and_the_limit_is_configurable(monkeypatch):
    small = _spec(world_size=4)
    verdict = capacity.check(small, HOST, capacity.Limits())
    assert verdict.ok and verdict.warnings == [
        "4 ranks on 2 cores: ranks time-share the cores, so the measured step time is longer than on one core per rank "
        "(the cpu step-time profile accounts for it)"]
    huge, problems = validate_spec({"parallel": {"strategy": "ddp", "world_size": 1_000_000},
                                    "train": {"global_batch": 1_000_000, "micro_batch": 1}})
    verdict = capacity.check(huge, HOST, capacity.Limits())
    assert verdict.problems == ["1,000,000 local ranks > 8 this host can run (2 cores x 4 ranks per core (at least 8); "
                                "set SHARDLAB_MAX_LOCAL_RANKS to change it, or submit to SLURM)"]
    assert verdict.need_bytes is None  # refused before any per-rank estimate
    monkeypatch.setenv("SHARDLAB_MAX_LOCAL_RANKS", "3")
    assert capacity.check(small, HOST).problems[0].startswith("4 local ranks > 3 this host can run "
                                                              "(SHARDLAB_MAX_LOCAL_RANKS")


def test_slurm_runs_are_not_bounded_by_this_host():
    spec, problems = validate_spec({"model": preset_model("llama-2-7b"), "runtime": {"executor": "slurm", "nnodes": 2},
                                    "parallel": {"strategy": "ddp", "world_size": 64}, "train": {"global_batch": 128}})
    assert not problems, problems
    assert capacity.check(spec, HOST).ok


def test_submit_refuses_a_million_local_ranks(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["submit", "--db", db, "--world", "1000000", "--global-batch", "1000000", "--micro-batch", "1"]) == 2
    err = capsys.readouterr().err
    assert "nothing queued: 1,000,000 local ranks >" in err and "Traceback" not in err
    assert main(["list", "--db", db, "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_run_refuses_before_launching(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert main(["run", "--preset", "llama-2-7b", "--strategy", "ddp", "--world", "2", "--workdir", str(workdir)]) == 2
    assert "nothing launched: this host cannot hold the run: 2 ranks need" in capsys.readouterr().err
    assert not workdir.exists()


def test_worker_fails_a_queued_run_that_cannot_fit_before_launching(tmp_path):
    from backend.worker.service import Worker
    from db import queries as q
    from db.session import open_db

    engine = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    eid = q.submit_experiment(engine, _spec(preset_model("llama-2-7b")))
    calls = []

    def runner(spec, **kw) -> RunResult:
        calls.append(spec)
        return RunResult(status=Status.OK, spec=spec)

    Worker(engine, runs_dir=tmp_path / "runs", runner=runner).serve(once=True)
    row = q.get_experiment(engine, eid)
    assert calls == [] and row["status"] == "failed"
    assert row["error"].startswith("not launched: this host cannot hold the run: 2 ranks need")


@pytest.fixture
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()
    return tmp_path


@pytest.mark.heavy
def test_new_experiment_disables_run_for_a_model_this_host_cannot_hold(ui_env):
    from dashboard import spec_form as sf

    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="f_preset").set_value(sf.preset_label("llama-2-7b")).run()
    assert not at.exception
    run = at.button(key="submit_one")
    assert run.disabled and "this host cannot hold the run" in run.help
    assert any("Cannot run on this host" in e.value and "Run it here" in e.value for e in at.error)
    assert not at.button(key="trace_full").disabled
    at.toggle(key="f_run_here").set_value(True).run()
    assert not at.exception and not at.button(key="submit_one").disabled


def test_failed_run_page_shows_the_log_tail_and_no_empty_charts(ui_env):
    from backend.launch.launcher import predicted_ranks
    from backend.run_folders import default_runs_dir
    from db import queries as q
    from db.session import open_db

    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    spec = _spec()
    eid = q.submit_experiment(engine, spec)
    # as the launcher stores a job that died without a word: the prediction per rank, nothing measured, no stored tail
    q.store_result(engine, eid, RunResult(status=Status.FAILED, spec=spec, per_rank=predicted_ranks(spec),
                                          error="torchrun exited with code 1; no rank reported an error "
                                                "(see log tail)"))
    log = default_runs_dir(engine) / str(eid) / "log.txt"
    log.parent.mkdir(parents=True)
    log.write_text("starting\nrank 0: Killed\n")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.query_params["run"] = str(eid)
    at.switch_page("dashboard/pages/run_detail.py").run()
    assert not at.exception
    assert any("rank 0: Killed" in c.value for c in at.code), "the log tail is shown"
    assert not at.get("plotly_chart"), "no charts of 0 B measured and -100% errors"


def test_a_cuda_spec_on_a_host_without_cuda_is_warned_before_it_is_queued(monkeypatch):
    """A GPU run's or a Plan layout's spec (device=cuda) opened here queued a run the launcher then failed; the
    warning says so first (not a refusal: a shared store's worker may have GPUs)."""
    monkeypatch.setattr("backend.engine.cuda_available", lambda: False)
    spec, problems = validate_spec({"parallel": {"strategy": "ddp", "world_size": 2}, "runtime": {"device": "cuda"}})
    assert not problems, problems
    verdict = capacity.check(spec, HOST, capacity.Limits())
    assert verdict.ok and any(w.startswith("device=cuda backend=auto needs CUDA, and this host has none")
                              and "Run it here" in w for w in verdict.warnings)
    assert not any("CUDA" in w for w in capacity.check(_spec(), HOST, capacity.Limits()).warnings)
