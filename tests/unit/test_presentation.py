"""Presentation and words a newcomer meets (issue 20 items 11 and 12), through AppTest: no "None" cells, no raw
floats or jargon column names in Plan, short metric values, legends beside (not over) the axes, one memory unit
(GiB), a tooltip for each term, the workflow on the home page and why Plan's top layout wins. The real-browser
check that no metric text is cut off is in tests/e2e/test_browser_lifecycle.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import spec_form as sf
from tests.helpers.store_helpers import fake_result, spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def _figs(at: AppTest) -> dict[str, dict]:
    out = {}
    for chart in at.get("plotly_chart"):
        fig = json.loads(chart.proto.spec)
        out[fig["layout"]["title"]["text"]] = fig
    return out


def _columns(df_element) -> dict:
    return json.loads(df_element.proto.columns or "{}")


def _legend_beside_the_plot(fig: dict) -> bool:
    legend = fig["layout"].get("legend", {})
    return legend.get("orientation", "v") == "v" and legend.get("x", 1.02) >= 1


def test_home_page_workflow_short_metrics_gib_and_tooltips():
    at = _ok(AppTest.from_file(APP, default_timeout=60).run())
    links = [e.proto.label for e in at.get("page_link")]
    assert links[:4] == ["1 · Plan", "2 · New experiment", "3 · Run", "4 · Compare"], "the workflow, in one line"
    values = {m.label: m.value for m in at.metric}
    assert values["comm / step"] == "527 KiB" and values["parameters"] == "135k", "three digits: nothing to cut off"
    assert all(len(v) <= 10 for v in values.values()), values
    assert all(m.help for m in at.metric
               if m.label in ("parameters", "comm / step", "pipeline bubble")), "each term explained"
    fit = next(s.value for s in at.success if s.value.startswith("Fits"))
    assert "of 74.51 GiB (80 GB)" in fit
    mem = next(f for t, f in _figs(at).items() if t.startswith("Predicted memory per rank"))
    assert _legend_beside_the_plot(mem)
    comm = next(d for d in at.dataframe if "collective" in d.value.columns)
    assert "on the wire, busiest rank" in comm.value.columns and "ring wire" not in " ".join(comm.value.columns)
    assert "ring algorithm sends per rank" in _columns(comm)["on the wire, busiest rank"]["help"]


def test_plan_table_words_formats_why_and_chart():
    at = _ok(AppTest.from_file(APP, default_timeout=120).run().switch_page("dashboard/pages/plan.py").run())
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2"))
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(32)
    at.button(key="pl_go").click()
    _ok(at.run())
    table = at.dataframe[0]
    names = list(table.value.columns)
    assert not {"v", "SP", "low s", "high s", "memory GB"} & set(names), names
    assert {"virtual stages", "sequence parallel", "step s (low)", "step s (high)", "memory GiB"} <= set(names)
    cols = _columns(table)
    for name in ("step s", "step s (low)", "step s (high)", "memory GiB", "MFU %", "tokens/s", "TFLOP/s per GPU"):
        assert cols[name]["type_config"].get("format"), f"{name} is shown as a raw float"
    for name in ("schedule", "virtual stages", "sequence parallel", "step s (low)", "MFU %", "runs", "fullest at"):
        assert cols[name].get("help"), f"{name} has no tooltip"
    assert table.proto.placeholder == "–"
    assert "zbv" not in set(table.value["schedule"].dropna())
    assert any(m.value.startswith("#1 is the fastest at") and "% of it" in m.value for m in at.markdown)
    breakdown = next(f for t, f in _figs(at).items() if t.startswith("Predicted step time by component"))
    assert breakdown["data"][0]["x"][:2] == ["#1", "#2"] and breakdown["layout"]["xaxis"]["type"] == "category"
    assert _legend_beside_the_plot(breakdown)
    pareto = next(f for t, f in _figs(at).items() if t.startswith("Memory vs predicted step time"))
    assert pareto["layout"]["yaxis"]["title"]["text"] == "worst rank at its fullest moment (GiB)"


def test_runs_compare_detail_and_formulas_words():
    from db import queries as q
    from db.session import open_db

    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    done = q.submit_experiment(engine, spec("done"))
    q.store_result(engine, done, fake_result(spec("done")))
    waiting = q.submit_experiment(engine, spec("waiting"))
    at = _ok(AppTest.from_file(APP, default_timeout=60).run().switch_page("dashboard/pages/runs.py").run())
    assert at.dataframe[0].proto.placeholder == "–", "a run not measured yet shows a dash, not None"
    at.session_state["compare_ids"] = [done, waiting]
    _ok(at.switch_page("dashboard/pages/compare.py").run())
    assert _columns(at.dataframe[0])["_index"]["width"] == "large", "row labels like '... (measured)' are not cut off"
    at.query_params["run"] = str(done)
    _ok(at.switch_page("dashboard/pages/run_detail.py").run())
    mfu = next(m for m in at.metric if m.label.startswith("achieved FLOP/s"))
    assert "HFU: hardware FLOPs utilization" in mfu.help
    _ok(at.switch_page("dashboard/pages/formulas.py").run())
    zero = next(f for t, f in _figs(at).items() if t.startswith("Model-state memory per GPU"))
    assert "2 + 2 + K = 16 bytes per parameter (K = 12 optimizer bytes)" in zero["layout"]["title"]["text"]
    assert "GiB" in zero["layout"]["yaxis"]["title"]["text"]
    assert any("4 + 4 + 4 = 12" in c.value for c in at.caption)
