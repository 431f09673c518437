"""Frameworks at the dashboard: the form's framework/offload choice, the runs table column and filter, the run
page's "DeepSpeed's estimate" column, and the three-frameworks comparison (no processes)."""

from __future__ import annotations

from backend.result import FrameworkEstimate, ModelStates, RunResult
from backend.spec import ExperimentSpec
from dashboard import framework_view as fv
from dashboard import spec_form as sf
from dashboard.runs_view import TABLE_KEYS, table_frame
from tests.helpers.store_helpers import fake_result, file_db, spec


def _ds(s: ExperimentSpec) -> ExperimentSpec:
    return ExperimentSpec.model_validate({**s.model_dump(mode="json"), "framework": "deepspeed"})


def test_form_round_trips_framework_and_offload() -> None:
    v = sf.default_form()
    v.update(framework="deepspeed", strategy="zero3", offload="params")
    s, problems = sf.form_to_spec(v)
    assert not problems and str(s.framework) == "deepspeed" and str(s.parallel.offload) == "params"
    back = sf.spec_to_form(s)
    assert back["framework"] == "deepspeed" and back["offload"] == "params"
    assert sf.describe(s).startswith("deepspeed · zero3") and "offload params" in sf.describe(s)
    v.update(framework="jax", strategy="zero2")
    _, problems = sf.form_to_spec(v)
    assert any("ZeRO-1/2 have no layout of their own" in p for p in problems)


def test_runs_table_and_filter_show_framework(tmp_path) -> None:
    from db import queries as q

    engine = file_db(tmp_path)
    q.submit_experiment(engine, spec("torch run", world_size=2))
    q.submit_experiment(engine, _ds(spec("ds run", world_size=2, strategy="zero2")))
    rows = q.list_experiments(engine, columns=TABLE_KEYS)
    assert sorted(table_frame(rows)["framework"]) == ["deepspeed", "torch"]
    only = q.list_experiments(engine, framework="deepspeed")
    assert [r["name"] for r in only] == ["ds run"] and q.count_experiments(engine, framework=["torch"]) == 1
    from db.export import export_csv

    text = export_csv(engine, framework=["deepspeed"])
    assert "framework" in text.splitlines()[0] and "deepspeed" in text and "torch run" not in text


def _with_estimate(res: RunResult) -> RunResult:
    for rr in res.per_rank:
        rr.model_states_measured = ModelStates(params_bytes=100, master_bytes=50, optimizer_state_bytes=100,
                                               total_bytes=250)
        rr.model_states_predicted = ModelStates(params_bytes=100, master_bytes=50, optimizer_state_bytes=100,
                                                total_bytes=250)
        rr.framework_estimate = FrameworkEstimate(source="DeepSpeed 0.19.8 estimate_zero2_model_states_mem_needs",
                                                  device_bytes=500, host_bytes=900)
    return res


def test_run_page_has_deepspeeds_estimate_column_only_where_present() -> None:
    s = _ds(spec("ds", world_size=2, strategy="zero2"))
    df = fv.model_state_frame(_with_estimate(fake_result(s)))
    assert fv.ESTIMATE_COLUMN in df.columns and list(df["error"]) == ["+0.0 %", "+0.0 %"]
    assert list(df["its error"]) == ["-50.0 %", "-50.0 %"]  # measured 250 B vs DeepSpeed's 500 B
    assert fv.model_state_frame(fake_result(spec("torch", world_size=2))).empty


def test_three_frameworks_compare() -> None:
    t = spec("t", world_size=2, strategy="zero3")
    runs = [(1, fake_result(t)), (2, _with_estimate(fake_result(_ds(t))))]
    df = fv.three_frameworks_frame(runs)
    assert list(df.columns) == ["#1 torch", "#2 deepspeed"] and df.loc["framework", "#2 deepspeed"] == "deepspeed"
    assert fv.same_model_and_strategy(runs) is None
    assert len(fv.three_frameworks_fig(runs).data) == 4


def test_new_experiment_page_predicts_the_frameworks_layout(tmp_path, monkeypatch) -> None:
    """The New-experiment form with framework deepspeed / jax shows ShardLab's prediction for that layout."""
    from pathlib import Path

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "pages" / "new_experiment.py"),
                           default_timeout=60).run()
    at.selectbox(key="f_framework").set_value("deepspeed")
    at.selectbox(key="f_strategy").set_value("zero2")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("DeepSpeed layout per rank" in i.value for i in at.info)
    at.selectbox(key="f_framework").set_value("jax")
    at.selectbox(key="f_strategy").set_value("zero3")
    at.run()
    assert not at.exception and any("XLA argument bytes" in i.value for i in at.info)
