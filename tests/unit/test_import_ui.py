"""Issue 25 on the dashboard (AppTest): an imported run's page (marked imported, predicted vs measured step time with
interval and breakdown, predicted categories beside the log's peaks, the warm-up rule), Runs / Compare / CSV with
imported runs, the Import config box on New experiment and Plan, and the calibrated profiles on Plan."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.importers import import_config
from backend.importers.runs import import_run

APP = str(Path(__file__).resolve().parents[2] / "app.py")
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"


@pytest.fixture(autouse=True)
def ui_env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()
    return url


def _engine():
    from db.session import open_db

    return open_db(os.environ["SHARDLAB_DB_URL"])


def _app() -> AppTest:
    return AppTest.from_file(APP, default_timeout=60).run()


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def _texts(at: AppTest) -> str:
    parts = [e.value for kind in ("error", "info", "success", "warning", "markdown", "caption", "text")
             for e in at.get(kind)]
    return "\n".join(str(p) for p in parts)


def _imported(engine, tags=("ourcluster",)) -> tuple[int, int]:
    tt = import_run(engine, config=FIX / "torchtitan_llama3_8b.toml", log=FIX / "torchtitan_llama3_8b.log", gpus=8,
                    tags=list(tags))
    ds = import_run(engine, config=FIX / "deepspeed_zero3.json", model_config=FIX / "llama2_7b_config.json",
                    log=FIX / "deepspeed_zero3.log", hardware="h100-sxm", tags=list(tags))
    return tt, ds


def test_imported_run_page(ui_env):
    tt, _ = _imported(_engine())
    at = _app()
    at.query_params["run"] = str(tt)
    _ok(at.switch_page("dashboard/pages/run_detail.py").run())
    text = _texts(at)
    assert "Imported run (torchtitan)" in text and "torchtitan_llama3_8b.log" in text
    labels = [m.label for m in at.metric]
    assert {"measured (median after warm-up)", "predicted", "prediction interval"} <= set(labels)
    assert "warm-up excluded" in text and "the log measures no category" in text.lower()
    memory = at.dataframe[0].value
    assert {"predicted activations", "measured peak allocated", "measured peak reserved"} <= set(memory.columns)
    assert memory["measured peak reserved"].iloc[0] == pytest.approx(63.21)
    fig = at.get("plotly_chart")[0].proto.spec
    assert "compute" in fig and "measured (median after warm-up)" in fig


def test_imported_runs_in_runs_compare_and_csv(ui_env):
    engine = _engine()
    tt, ds = _imported(engine)
    at = _app()
    _ok(at.switch_page("dashboard/pages/runs.py").run())
    table = at.dataframe[0].value
    assert set(table["framework"]) >= {"torchtitan (imported)", "deepspeed (imported)"}
    assert all(n.startswith("[imported] ") for n in table["name"])
    at.session_state["compare_ids"] = [tt, ds]
    _ok(at.switch_page("dashboard/pages/compare.py").run())
    cmp = at.dataframe[0].value
    row = cmp.loc["memory, fullest rank: measured"]
    assert all("peak allocated" in v and "(log)" in v for v in row)
    from db.export import export_csv

    rows = list(csv.DictReader(io.StringIO(export_csv(engine))))
    by_id = {int(r["id"]): r for r in rows}
    assert by_id[tt]["kind"] == "imported" and by_id[tt]["source_framework"] == "torchtitan"
    assert int(by_id[tt]["peak_reserved_bytes"]) == int(63.21 * 2**30) and by_id[tt]["peak_allocated_bytes"] == ""
    assert by_id[tt]["measured_params_bytes"] == ""  # a log measures no category: blank, never 0
    assert float(by_id[tt]["step_time_predicted_s"]) > 0


def test_import_box_loads_the_spec_into_the_form(ui_env):
    imported = import_config(FIX / "deepspeed_zero3.json", model_config=FIX / "llama2_7b_config.json")
    at = _app()
    at.session_state["ne_imp_result"] = imported
    _ok(at.run())
    assert "deepspeed (deepspeed-json), 16 GPUs" in _texts(at)
    load = next(b for b in at.button if b.key == "ne_imp_load")
    _ok(load.click().run())
    assert at.number_input(key="f_world_size").value == 16 and at.number_input(key="f_d_model").value == 4096
    assert at.selectbox(key="f_strategy").value == "zero3"


def test_import_box_errors_are_plain_text(ui_env):
    from dashboard import import_view as iv

    imported, problems = iv.import_uploaded(b"[model]\nname = \"llama3\"\nflavor = \"![x](http://evil/x.png)\"\n",
                                            "job.toml", fmt=None, gpus=8)
    assert imported is None and "not a torchtitan flavor" in problems[0]
    at = _app()
    at.session_state["ne_imp_problems"] = problems
    _ok(at.run())
    assert any("![x](http://evil/x.png)" in t.value for t in at.text)  # shown as text
    assert not any("evil" in m.value for m in at.markdown)  # never rendered as markdown (no image fetched)


@pytest.mark.heavy
def test_plan_page_imports_a_config_and_shows_the_calibrated_profile(ui_env):
    engine = _engine()
    _imported(engine)
    from backend.calibration.calibrate import calibrate

    out = calibrate(engine, hardware="h100-sxm", tag="ourcluster", name="h100-ourcluster")
    imported = import_config(FIX / "torchtitan_llama3_8b.toml", gpus=16)
    at = _app()
    at.session_state["pl_imp_result"] = imported
    _ok(at.switch_page("dashboard/pages/plan.py").run())
    _ok(next(b for b in at.button if b.key == "pl_imp_load").click().run())
    assert at.radio(key="pl_source").value == "imported config" and at.number_input(key="pl_gpus").value == 16
    assert "h100-ourcluster" in at.selectbox(key="pl_hw").options
    at.selectbox(key="pl_hw").set_value("h100-ourcluster")
    at.number_input(key="pl_batch").set_value(64)
    _ok(at.run())
    _ok(next(b for b in at.button if b.key == "pl_go").click().run())
    text = _texts(at)
    assert (f"calibration {out['id']} of h100-sxm on 2 runs" in text.lower()
            or f"calibration {out['id']} of h100-sxm" in text)
    assert "leave-one-out error" in text
    profiles = next(d.value for d in at.dataframe
                    if "leave-one-out error %" in d.value.columns and "profile" in d.value.columns)
    assert list(profiles["profile"]) == ["h100-ourcluster"]
    assert profiles["leave-one-out error %"].iloc[0] == pytest.approx(out["loo_mape"])


def test_loading_a_spec_never_renders_its_name_as_markdown(ui_env):
    """A spec loaded into the form (a cloned run, an imported config) toasts without its name: a toast renders
    markdown, and a name is user text (an imported job description) that could fetch an image."""
    from backend.spec import ExperimentSpec

    imported = import_config(FIX / "deepspeed_zero3.json", model_config=FIX / "llama2_7b_config.json")
    spec = ExperimentSpec.for_prediction({**imported.spec, "name": "![x](http://evil.example/x.png)"})
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["clone_spec"] = spec
    _ok(at.run())
    assert at.toast and all("evil" not in t.value for t in at.toast)
    assert at.text_input(key="f_name").value == "![x](http://evil.example/x.png)"  # kept, as plain text in the form
