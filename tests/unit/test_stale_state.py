"""Stale state (issue 20 item 9): Plan keeps the inputs of the results it shows, Run detail's picker does not say
'running' after the run ended, the Formulas page gives the CPU time-sharing caveat beside a measured bubble.
(The sidebar's worker state: tests/unit/test_worker_lifecycle.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import spec_form as sf
from db import queries as q
from db.session import open_db
from tests.helpers.store_helpers import fake_result, spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
CAVEAT = ("Bubble: 2 ranks on 2 CPU cores at load average 3.1; when the ranks do not each get a core, stages "
          "time-share the CPU and cannot overlap, so the measured bubble tends to 1 - 1/pp whatever the schedule.")


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()


def _engine():
    return open_db(os.environ["SHARDLAB_DB_URL"])


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


@pytest.mark.heavy
def test_plan_inputs_come_back_with_their_results():
    at = _ok(AppTest.from_file(APP, default_timeout=120).run().switch_page("dashboard/pages/plan.py").run())
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2"))
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(32)
    at.button(key="pl_go").click()
    _ok(at.run())
    rows = len(at.dataframe[0].value)
    _ok(at.switch_page("dashboard/pages/runs.py").run())
    _ok(at.switch_page("dashboard/pages/plan.py").run())
    assert (at.number_input(key="pl_gpus").value, at.number_input(key="pl_batch").value) == (8, 32)
    assert at.selectbox(key="pl_preset").value == sf.preset_label("gpt2")
    assert len(at.dataframe[0].value) == rows and not at.main.warning, "results and inputs match"
    at.number_input(key="pl_gpus").set_value(16)
    _ok(at.run())
    assert any("These results are for gpt2" in w.value for w in at.main.warning)


def test_run_detail_picker_does_not_say_running_after_the_run_ended():
    engine = _engine()
    eid = q.submit_experiment(engine, spec("r"))
    q.register_worker(engine, "h:1:0", pid=1, host="h", pid_started=None)
    assert q.claim_next(engine, "h:1:0", host="h") == eid
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.query_params["run"] = str(eid)
    _ok(at.switch_page("dashboard/pages/run_detail.py").run())
    assert at.selectbox[0].format_func(at.selectbox[0].value).endswith("running")
    q.store_result(engine, eid, fake_result(spec("r")))
    _ok(at.run())  # within the 2 s the page caches its reads
    assert at.selectbox[0].format_func(at.selectbox[0].value).endswith("· ok")


def test_formulas_page_gives_the_time_sharing_caveat_of_a_measured_bubble():
    engine = _engine()
    s = spec("pp", strategy="pp", pp_schedule="gpipe")
    res = fake_result(s)
    res.notes = [CAVEAT]
    res.bubble_measured, res.bubble_predicted = 0.703, 0.2
    q.store_result(engine, q.submit_experiment(engine, s), res)
    at = _ok(AppTest.from_file(APP, default_timeout=60).run().switch_page("dashboard/pages/formulas.py").run())
    checks = next(d.value for d in at.dataframe if "check" in d.value.columns)
    row = checks[checks["check"].str.startswith("pipeline bubble")].iloc[0]
    assert (row["measured"], row["formula"], row["caveat"]) == ("70.3 %", "20.0 %", CAVEAT)
    assert any("time-share the CPU" in c.value for c in at.caption)
