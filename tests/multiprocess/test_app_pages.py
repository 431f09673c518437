"""Dashboard pages on runs the real launcher measured: measured vs predicted, pipeline timelines, every page of a full store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.result import RunResult, Status
from backend.spec import validate_spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
PAGES = ("dashboard/pages/new_experiment.py", "dashboard/pages/runs.py", "dashboard/pages/run_detail.py", "dashboard/pages/compare.py", "dashboard/pages/formulas.py")
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


# ---- real measured runs ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def real_results(tmp_path_factory):
    """One tiny real DDP run and one tiny real PP run through the launcher (skip if the engine is unavailable)."""
    try:
        from backend.launch.launcher import run_experiment
    except ImportError as e:
        pytest.skip(f"backend.launch.launcher.run_experiment is not available yet: {e}")
    out = {}
    for name, spec in (("ddp", _spec("ddp")), ("pp", _spec("pp", 2, pp_schedule="gpipe"))):
        res = run_experiment(spec, workdir=tmp_path_factory.mktemp(f"run_{name}"))
        if res.status != Status.OK:
            pytest.skip(f"the tiny real {name} run did not finish ok ({res.status}: {res.error})")
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
def test_detail_of_a_real_run_shows_measured_vs_predicted(real_results):
    ids = _store(real_results)
    at = _app()
    at.query_params["run"] = str(ids["ddp"])
    at.switch_page("dashboard/pages/run_detail.py")
    _ok(at.run())
    figs = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    mvp = next(f for t, f in figs.items() if t.startswith("Memory per rank"))
    params = next(t for t in mvp["data"] if t["name"] == "parameters")
    assert len(params["y"]) == 4 and all(y > 0 for y in params["y"])  # 2 ranks x (measured, predicted)
    assert any(t.startswith("Training loss") for t in figs)
    assert "all_reduce" in set(at.dataframe[1].value["collective"])


@pytest.mark.slow
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
