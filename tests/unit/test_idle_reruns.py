"""Nothing re-runs while nothing runs (issue 30 item 7): the sidebar's worker badge re-ran every 5 s on every page,
and Plan's verification table every 2 s forever, so one idle tab kept the server at 7.8% of a core. Each fragment
timer is set only while a run it shows is queued or running (recorded here from st.fragment's run_every; the browser
test tests/e2e/test_browser_idle.py counts the reruns a real tab asks for, benchmarks/idle_dashboard.py the CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from db import queries as q
from db.session import open_db
from tests.helpers.store_helpers import fake_result, spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.fixture
def timers(tmp_path, monkeypatch):
    """{fragment function name: the run_every it was last set up with} for every st.fragment of a script run."""
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    seen: dict[str, float | None] = {}
    real = st.fragment

    def recording(func=None, *, run_every=None):
        def wrap(f):
            seen[f.__name__] = run_every
            return real(f, run_every=run_every)
        return wrap(func) if func is not None else wrap

    monkeypatch.setattr(st, "fragment", recording)
    return seen


def _finish(engine, eid: int) -> None:
    s = q.get_experiment(engine, eid)["spec"]
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(s))


def test_the_worker_badge_refreshes_only_while_a_run_is_queued_or_running(timers):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert timers == {"_worker_panel": None}  # idle: no timer (before: every 5 s)
    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    eid = q.submit_experiment(engine, spec("queued"))
    st.cache_data.clear()
    at.switch_page("dashboard/pages/runs.py").run()
    assert timers["_worker_panel"] == 5.0 and timers["_live_progress"] == 2.0
    _finish(engine, eid)
    st.cache_data.clear()
    at.run()
    assert timers["_worker_panel"] is None and not at.exception


@pytest.mark.heavy
def test_plans_verification_table_stops_refreshing_when_its_runs_have_ended(timers):
    from dashboard import spec_form as sf

    at = AppTest.from_file(APP, default_timeout=120).run()
    at.switch_page("dashboard/pages/plan.py").run()
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2")).run()
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(32)
    at.button(key="pl_go").click().run()
    assert not at.exception
    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    eid = q.submit_experiment(engine, spec("scaled-down"), tags=["verify-x", "verify-plan"])
    at.session_state["pl_verify_tag"] = "verify-x"
    st.cache_data.clear()
    at.run()
    assert timers["_verify_table"] == 2.0  # the verification run is queued: watched
    heading = [m.value for m in at.markdown if "Scaled-down verification" in m.value]
    assert heading and "runs on CPU" in heading[0] and "proxy" not in heading[0]  # one name, not three
    _finish(engine, eid)
    st.cache_data.clear()
    at.run()
    assert not at.exception and timers["_verify_table"] is None  # before: every 2 s for as long as the tab is open
