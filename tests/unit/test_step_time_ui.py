"""The step-time prediction can be checked in the UI (issue 20 item 4): the 'cpu' profile is measured by the worker on
first need (or the pages say what to run), and New experiment, Run detail and Plan's Verify show the predicted step.
The worker's real probe runs in a child process, once, before its first local run (multiprocess)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.bench import cpu_profile
from backend.result import RunResult, Status
from tests.helpers.store_helpers import fake_result, spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
PROFILE = {"name": "test host", "kind": "cpu", "peak_flops": {"fp32": 5e10, "bf16": 5e10, "fp16": 5e10},
           "hbm_bytes_per_s": 1e10, "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9, "gpus_per_node": 4096,
           "cores": 2, "tune": {"intra_latency_s": 1e-4, "inter_latency_s": 1e-4, "dtensor_op_s": 1e-4}}


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(tmp_path / "hardware_cpu.json"))  # absent until written
    import streamlit as st

    st.cache_data.clear()
    return tmp_path


def _write_profile(tmp_path: Path) -> None:
    (tmp_path / "hardware_cpu.json").write_text(json.dumps(PROFILE))


def _engine():
    from db.session import open_db

    return open_db(os.environ["SHARDLAB_DB_URL"])


def _texts(at: AppTest) -> str:
    return "\n".join(str(e.value) for kind in ("info", "caption", "warning", "text") for e in at.get(kind))


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_new_experiment_shows_the_predicted_step_time_or_what_to_run(env):
    at = _ok(AppTest.from_file(APP, default_timeout=60).run())
    assert "python -m backend.bench.hw_probe" in _texts(at), "without a cpu profile the page says what to run"
    _write_profile(env)
    import streamlit as st

    st.cache_data.clear()
    at = _ok(AppTest.from_file(APP, default_timeout=60).run())
    metric = next(m for m in at.metric if m.label == "step time (predicted)")
    assert metric.value.endswith(" s") and float(metric.value.split()[0]) > 0
    at.selectbox(key="f_step_hw").set_value("h100-sxm")
    _ok(at.run())
    assert any(m.label == "step time (predicted)" for m in at.metric)


@pytest.mark.heavy
def test_plan_layout_keeps_its_hardware_in_new_experiment(env):
    from dashboard import plan_view as pv

    res = pv.run_plan(pv.ModelSpec(**{**pv.LLAMA70B, "seq_len": 4096}), gpus=64, gpus_per_node=8, hardware="h100-sxm",
                      global_batch=128, memory_gb=None, top=3)
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.session_state["clone_spec"] = pv.spec_for_form(res, 0)
    at.session_state["clone_hardware"] = ("h100-sxm", 8)
    _ok(at.run())
    assert at.selectbox(key="f_step_hw").value == "h100-sxm"
    shown = float(next(m for m in at.metric if m.label == "step time (predicted)").value.split()[0])
    assert shown == pytest.approx(res.configs[0]["step_time"]["step_s"], rel=1e-2), (
        "Plan's step time survives the hand-over")


def test_run_detail_says_why_there_is_no_step_comparison_then_shows_it(env):
    eid = _ok_run()
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.query_params["run"] = str(eid)
    _ok(at.switch_page("dashboard/pages/run_detail.py").run())
    assert "No step-time comparison: No 'cpu' step-time profile yet" in _texts(at)
    _write_profile(env)
    _ok(at.run())
    labels = {m.label for m in at.metric}
    assert {"step time measured (min over steps)", "step time predicted"} <= labels


def _ok_run(tags: tuple[str, ...] = ()) -> int:
    from db import queries as q

    s = spec("timed")
    eid = q.submit_experiment(_engine(), s, tags=list(tags))
    res = fake_result(s)
    res.env = {**res.env, "device": "cpu"}
    q.store_result(_engine(), eid, res)
    return eid


def test_verify_table_has_numbers_or_reasons(env):
    from dashboard import plan_view as pv
    from db import queries as q

    done = _ok_run(("verify-x",))
    waiting = q.submit_experiment(_engine(), spec("scaled-down"), tags=["verify-x"])
    failed = q.submit_experiment(_engine(), spec("broken"), tags=["verify-x"])
    q.store_result(_engine(), failed, RunResult(status=Status.FAILED, spec=spec("broken"), error="rank 1 raised"))
    df = pv.verify_frame(_engine(), "verify-x").set_index("run")
    assert df.loc[done, "note"] == cpu_profile.MISSING and df.loc[waiting, "note"] == "waiting for a worker"
    assert df.loc[failed, "note"] == "failed: rank 1 raised"
    _write_profile(env)
    df = pv.verify_frame(_engine(), "verify-x").set_index("run")
    # min over steps of the slowest rank
    assert df.loc[done, "predicted s"] > 0 and df.loc[done, "measured s"] == pytest.approx(0.140625)
    assert df.loc[done, "note"] == ""


# ---- in processes of their own ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.slow
def test_worker_measures_this_host_once_before_its_first_local_run(tmp_path, monkeypatch):
    """The real probe (hw_probe in a child process, ~10 s) writes the profile the step-time model loads as 'cpu'."""
    from backend.analytic.steptime.hardware import get_hardware
    from backend.worker.service import Worker
    from db import queries as q
    from db.session import open_db

    path = tmp_path / "hardware_cpu.json"
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(path))
    monkeypatch.setenv(cpu_profile.AUTO_ENV, "1")
    engine = open_db(f"sqlite:///{tmp_path / 'w.db'}")
    ids = [q.submit_experiment(engine, spec(name)) for name in ("first", "second")]
    seen = []

    def runner(s, **kw):
        seen.append(path.exists())
        return fake_result(s)

    Worker(engine, runs_dir=tmp_path / "runs", runner=runner).serve(drain=True)
    assert seen == [True, True] and all(q.get_status(engine, i) == "ok" for i in ids)
    assert get_hardware("cpu").kind == "cpu"
