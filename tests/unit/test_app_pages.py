"""Drive every dashboard page with Streamlit's AppTest: empty store, queued, failed and real finished runs (measured
by the engine's ranks: farm jobs): measured vs predicted, pipeline timelines, every page of a full store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.result import RunResult, Status
from backend.spec import validate_spec
from dashboard import spec_form as sf
from tests.helpers.farm import engine_job, uses

APP = str(Path(__file__).resolve().parents[2] / "app.py")
PAGES = ("dashboard/pages/new_experiment.py", "dashboard/pages/runs.py", "dashboard/pages/run_detail.py",
         "dashboard/pages/compare.py", "dashboard/pages/formulas.py")
TINY = {"model": {"vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1}}


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
    return AppTest.from_file(APP, default_timeout=30).run()


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def _spec(strategy="ddp", world=2, **parallel):
    spec, problems = validate_spec({**TINY, "parallel": {"strategy": strategy, "world_size": world, **parallel}})
    assert not problems, problems
    return spec


def _texts(at: AppTest) -> str:
    parts = [e.value for kind in ("error", "info", "success", "warning", "markdown", "caption", "text")
             for e in at.get(kind)]
    parts += [c.value for c in at.code]
    return "\n".join(str(p) for p in parts)


def test_every_page_renders_on_an_empty_store():
    at = _app()
    _ok(at)
    assert at.get("plotly_chart"), "the prediction chart shows before any run exists"
    for page in PAGES[1:]:
        _ok(at.switch_page(page).run())
    at.switch_page("dashboard/pages/runs.py").run()
    assert "No runs yet" in _texts(at)


def test_form_shows_validation_errors_with_the_arithmetic():
    at = _app()
    at.number_input(key="f_world_size").set_value(3)
    at.number_input(key="f_tp").set_value(2)
    _ok(at.run())
    errors = " ".join(e.value for e in at.error)
    assert "world_size(3) is not divisible by tp(2) * pp(1) = 2" in errors
    assert not at.get("plotly_chart")
    assert not [b for b in at.button if b.key == "submit_one"], "an invalid spec cannot be submitted"


def _bytes(fig: dict, name: str) -> float:
    unit = fig["layout"]["yaxis"]["title"]["text"].rsplit("(", 1)[1].rstrip(")")
    trace = next(t for t in fig["data"] if t["name"] == name)
    return trace["y"][0] * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_prediction_updates_live_and_fit_check():
    at = _app()
    before = json.loads(at.get("plotly_chart")[0].proto.spec)
    at.selectbox(key="f_strategy").set_value("zero3")
    at.number_input(key="f_world_size").set_value(4)
    at.number_input(key="f_micro_batch").set_value(1)
    _ok(at.run())
    after = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert len(after["data"][0]["x"]) == 4 and len(before["data"][0]["x"]) == 2
    # zero3 shards the Adam state over 4 ranks; ddp replicates it
    assert _bytes(after, "optimizer state") < _bytes(before, "optimizer state") / 3
    assert any("Fits" in s.value for s in at.success)
    at.selectbox(key="f_preset").set_value(sf.preset_label("llama-2-70b")).run()  # was the "LLaMA-70B-like" shape
    at.number_input(key="f_device_mem_gb").set_value(80.0)
    _ok(at.run())
    assert any("Does not fit" in e.value for e in at.error)


def test_submit_then_history_detail_cancel_and_compare():
    at = _app()
    at.text_input(key="f_name").set_value("ui smoke")
    at.text_input(key="submit_tags").set_value("smoke, ui")
    at.button(key="submit_one").click()
    _ok(at.run())
    assert any("Queued run #1" in s.value for s in at.success)
    from db import queries

    eng = _engine()
    row = queries.get_experiment(eng, 1)
    assert row["status"] == "queued" and row["tags"] == ["smoke", "ui"] and row["spec"].name == "ui smoke"
    queries.submit_experiment(eng, _spec("zero2"), tags=["other"])

    at.switch_page("dashboard/pages/runs.py")
    _ok(at.run())
    df = at.dataframe[0].value
    assert sorted(df["id"]) == [1, 2] and set(df["progress"]) == {"waiting for a worker"}
    assert "In progress" in [h.value for h in at.subheader]
    at.text_input(key="runs_tag").set_value("smoke")
    _ok(at.run())
    assert list(at.dataframe[0].value["id"]) == [1]
    at.text_input(key="runs_tag").set_value("")
    _ok(at.run())
    at.multiselect(key="runs_selected").set_value([1, 2])
    _ok(at.run())
    at.button(key="act_cancel").click()
    _ok(at.run())
    assert queries.get_experiment(eng, 1)["status"] == "cancelled"

    at.session_state["run_id"] = 1
    at.switch_page("dashboard/pages/run_detail.py")
    _ok(at.run())
    assert "#1 ui smoke" in _texts(at) or any("#1" in m.value for m in at.markdown)
    assert "cancelled" in _texts(at)

    at.session_state["compare_ids"] = [1, 2]
    at.switch_page("dashboard/pages/compare.py")
    _ok(at.run())
    cmp_df = at.dataframe[0].value
    assert list(cmp_df.columns) == ["#1 ui smoke", "#2"]
    assert cmp_df.loc["strategy"].tolist() == ["ddp", "zero2"]


def test_rerun_delete_and_tags_from_the_history():
    from db import queries

    eng = _engine()
    eid = queries.submit_experiment(eng, _spec())
    queries.cancel_experiment(eng, eid)
    at = _app().switch_page("dashboard/pages/runs.py").run()
    at.multiselect(key="runs_selected").set_value([eid])
    at.run()
    at.button(key="act_rerun").click()
    _ok(at.run())
    assert queries.count_experiments(eng) == 2
    at.text_input(key="act_tags").set_value("keep, me")
    at.multiselect(key="runs_selected").set_value([eid])
    at.run()
    at.button(key="act_tag_apply").click()
    _ok(at.run())
    assert queries.get_experiment(eng, eid)["tags"] == ["keep", "me"]
    at.multiselect(key="runs_selected").set_value([eid])
    at.checkbox(key="act_delete_confirm").check()
    at.run()
    at.button(key="act_delete").click()
    _ok(at.run())
    assert queries.get_experiment(eng, eid) is None


def test_a_delete_confirmation_does_not_carry_over_to_the_next_selection():
    """The 'Yes, delete' tick stayed on after a delete: the next run selected was deleted by one click."""
    from db import queries

    eng = _engine()
    first, second = queries.submit_experiment(eng, _spec()), queries.submit_experiment(eng, _spec())
    at = _app()
    at.switch_page("dashboard/pages/runs.py").run()
    at.multiselect(key="runs_selected").set_value([first]).run()
    at.checkbox(key="act_delete_confirm").check().run()
    at.button(key="act_delete").click()
    _ok(at.run())
    assert queries.get_experiment(eng, first) is None
    at.multiselect(key="runs_selected").set_value([second]).run()
    assert not at.checkbox(key="act_delete_confirm").value and at.button(key="act_delete").disabled
    at.checkbox(key="act_delete_confirm").check().run()
    at.multiselect(key="runs_selected").set_value([]).run()
    at.multiselect(key="runs_selected").set_value([second]).run()
    assert not at.checkbox(key="act_delete_confirm").value, "a changed selection needs a new confirmation"


def test_sweep_submission():
    at = _app()
    at.multiselect(key="sweep_strategies").set_value(["ddp", "zero1", "tp"])
    at.multiselect(key="sweep_worlds").set_value([2, 4])
    _ok(at.run())
    at.button(key="submit_sweep").click()
    _ok(at.run())
    from db import queries

    rows = queries.list_experiments(_engine())
    assert len(rows) == 6 and len({r["sweep_id"] for r in rows}) == 1
    assert sorted((r["strategy"], r["world_size"]) for r in rows)[0] == ("ddp", 2)


def test_sweep_runs_get_the_tags_field_s_tags():
    at = _app()
    at.text_input(key="submit_tags").set_value("zero-study, sweep")
    at.multiselect(key="sweep_strategies").set_value(["ddp", "zero2"])
    _ok(at.run())
    at.button(key="submit_sweep").click()
    _ok(at.run())
    from db import queries

    rows = queries.list_experiments(_engine())
    assert len(rows) == 2 and all(r["tags"] == ["sweep", "zero-study"] for r in rows)


@pytest.mark.parametrize("asked", ["99999999999999999999", "²", "abc"])
def test_run_detail_address_with_no_run_id_says_so(asked):
    """A typed ?run= too long for the store's ids or not a number was a traceback (overflow / int('²'))."""
    from db import queries

    eid = queries.submit_experiment(_engine(), _spec())
    at = _app()
    at.query_params["run"] = asked
    at.switch_page("dashboard/pages/run_detail.py").run()
    _ok(at)
    assert any("names no run id" in w.value for w in at.warning) and f"#{eid}" in _texts(at)


def test_failed_run_shows_error_rank_and_log_tail():
    from db import queries

    eng = _engine()
    eid = queries.submit_experiment(eng, _spec())
    # Synthetic failure: only the failure rendering is under test here.
    queries.store_result(eng, eid, RunResult(status=Status.FAILED, error="RuntimeError: injected fault at step 1",
                                             failing_rank=1, traceback="Traceback (most recent call last):\n  ...",
                                             log_tail="rank 1 raised", spec=_spec()))
    at = _app()
    at.query_params["run"] = str(eid)
    at.switch_page("dashboard/pages/run_detail.py")
    _ok(at.run())
    text = _texts(at)
    assert "injected fault" in text and "Failing rank: **1**" in text and "rank 1 raised" in text
    for page in PAGES:
        _ok(at.switch_page(page).run())


def test_formulas_page_without_runs():
    at = _app().switch_page("dashboard/pages/formulas.py").run()
    _ok(at)
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    titles = " ".join(f["layout"]["title"]["text"] for f in figs)
    assert "Model-state memory per GPU" in titles and "bubble" in titles
    zero = figs[0]
    ddp = next(t for t in zero["data"] if t["name"].startswith("DDP"))
    assert ddp["y"][0] == pytest.approx(16 * 70e9 / 2**30)  # 70B, bf16 + Adam: 16 bytes per parameter, in GiB


def test_formulas_page_checks_the_model_against_published_runs(monkeypatch):
    """The "Published runs" tab predicts a stack's published runs on a click (two rows here, for time) and shows the
    summary against the targets, the predicted-against-published chart and the rows."""
    import backend.analytic.steptime.published_check as pc

    rows = tuple(r for r in pc.published_rows() if r.id in ("titan-202412-t4-70b-2d", "nemo2407-h100-llama3-8b-g8"))
    monkeypatch.setattr(pc, "published_rows", lambda: rows)
    at = _app().switch_page("dashboard/pages/formulas.py").run()
    at.selectbox(key="fx_pub_stack").set_value("torchtitan")
    at.button(key="fx_pub_go").click().run()
    _ok(at)
    frames = [d.value for d in at.dataframe]
    summary = next(f for f in frames if "step worst |error| %" in f.columns)
    assert list(summary["stack"]) == ["torchtitan"] and list(summary["rows"]) == [1]
    table = next(f for f in frames if "published step s" in f.columns)
    assert list(table["run"]) == ["titan-202412-t4-70b-2d"] and list(table["published peak GiB"]) == [71.9]
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.startswith("Predicted against published step time") for t in titles)


# ---- real measured runs ---------------------------------------------------------------------------

REAL = {"ddp": engine_job(_spec("ddp")), "pp": engine_job(_spec("pp", 2, pp_schedule="gpipe"))}


@pytest.fixture
def real_results(farm) -> dict[str, RunResult]:
    """One tiny real DDP run and one tiny real PP run (the engine's rank program, as the launcher runs it)."""
    out = {}
    for name, job in REAL.items():
        res = farm.result(job)["result"]
        assert res.status == Status.OK, (name, res.status, res.error)
        out[name] = res
    return out


def _store(results: dict[str, RunResult]) -> dict[str, int]:
    from db import queries

    eng = _engine()
    ids = {}
    for name, res in results.items():
        ids[name] = queries.submit_experiment(eng, res.spec, tags=["real"])
        queries.store_result(eng, ids[name], res)
    return ids


@pytest.mark.slow
@uses(*REAL.values())
def test_detail_of_a_real_run_shows_measured_vs_predicted(real_results):
    ids = _store(real_results)
    at = _app()
    at.query_params["run"] = str(ids["ddp"])
    at.switch_page("dashboard/pages/run_detail.py")
    _ok(at.run())
    figs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
            for c in at.get("plotly_chart")}
    mvp = next(f for t, f in figs.items() if t.startswith("Memory per rank"))
    params = next(t for t in mvp["data"] if t["name"] == "parameters")
    assert len(params["y"]) == 4 and all(y > 0 for y in params["y"])  # 2 ranks x (measured, predicted)
    assert any(t.startswith("Training loss") for t in figs)
    assert "all_reduce" in set(at.dataframe[1].value["collective"])


@pytest.mark.slow
@uses(*REAL.values())
def test_pp_run_shows_measured_and_ideal_timelines(real_results):
    ids = _store(real_results)
    at = _app()
    at.query_params["run"] = str(ids["pp"])
    at.switch_page("dashboard/pages/run_detail.py")
    _ok(at.run())
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.startswith("Ideal schedule") for t in titles)
    if real_results["pp"].timeline:
        assert any(t.startswith("Measured: gpipe") for t in titles)
    assert [m.label for m in at.metric if "bubble" in m.label]


@pytest.mark.slow
@uses(*REAL.values())
def test_full_store_renders_every_page_and_compares(real_results):
    ids = _store(real_results)
    at = _app().switch_page("dashboard/pages/runs.py").run()
    _ok(at)
    assert at.dataframe[0].value["step time (ms)"].notna().all()
    at.session_state["compare_ids"] = [ids["ddp"], ids["pp"]]
    at.switch_page("dashboard/pages/compare.py")
    _ok(at.run())
    figs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    mem = figs[0]
    measured = [t for t in mem["data"] if t["name"].endswith("measured")]
    assert {t["name"] for t in measured} == {"ddp measured", "pp measured"}
    assert all(y > 0 for t in measured for y in t["y"])
    for page in PAGES:
        _ok(at.switch_page(page).run())
    if real_results["pp"].bubble_measured is not None:  # the Formulas page checks the stored pp run's bubble
        at.switch_page("dashboard/pages/formulas.py").run()
        checks = [d.value for d in at.dataframe if "check" in d.value.columns]
        assert checks and any(c.startswith("pipeline bubble, gpipe") for c in checks[0]["check"]), checks
