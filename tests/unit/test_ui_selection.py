"""Selections are run ids (Runs, Compare) or layouts of one search (Plan), never row positions of another view
(issue 20 item 1: typing a tag filter re-pointed "Selected runs" to another run, or raised IndexError)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.spec import validate_spec
from dashboard import selection

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TINY = {"model": {"vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1}}


@pytest.fixture(autouse=True)
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()


def _engine():
    from db.session import open_db

    return open_db(os.environ["SHARDLAB_DB_URL"])


def _submit(strategy: str, tags: list[str]) -> int:
    from db import queries

    spec, problems = validate_spec({**TINY, "parallel": {"strategy": strategy, "world_size": 2}})
    assert not problems
    return queries.submit_experiment(_engine(), spec, tags=tags)


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def _tick(at: AppTest, rows: list[int]) -> AppTest:
    """Tick these row positions of the table as shown, the way the browser reports a click."""
    at.session_state[at.dataframe[0].key] = {"selection": {"rows": rows, "columns": [], "cells": []}}
    return _ok(at.run())


def test_helpers_map_positions_of_their_own_view_only():
    assert selection.picked_ids([0, 2, 5], [7, 8, 9]) == [7, 9]
    assert selection.split_in_view([3, 1, 2], [1, 2]) == ([1, 2], [3])
    assert selection.view_key("t", [1, 2]) != selection.view_key("t", [2, 1])
    assert selection.view_key("t", [1, 2]) == selection.view_key("t", [1, 2])


def test_runs_filter_never_repoints_the_selection():
    first, second, third = _submit("ddp", ["x"]), _submit("zero2", ["y"]), _submit("zero3", ["x"])
    at = _ok(AppTest.from_file(APP, default_timeout=30).run().switch_page("dashboard/pages/runs.py").run())
    assert list(at.dataframe[0].value["id"]) == [third, second, first]
    _tick(at, [0])
    assert at.multiselect(key="runs_selected").value == [third]
    at.text_input(key="runs_tag").set_value("y")
    _ok(at.run())
    assert list(at.dataframe[0].value["id"]) == [second]
    assert at.multiselect(key="runs_selected").value == [], "the filtered-out run must not become another run"
    assert any(f"#{third} left the selection" in w.value for w in at.warning)


def test_runs_two_ticked_rows_then_filter_keeps_ids_no_index_error():
    first, second, third = _submit("ddp", ["x"]), _submit("zero2", ["y"]), _submit("zero3", ["x"])
    at = _ok(AppTest.from_file(APP, default_timeout=30).run().switch_page("dashboard/pages/runs.py").run())
    at.selectbox(key="runs_order").set_value("id")
    at.toggle(key="runs_desc").set_value(False)
    _ok(at.run())
    assert list(at.dataframe[0].value["id"]) == [first, second, third]
    _tick(at, [1, 2])
    assert at.multiselect(key="runs_selected").value == [second, third]
    at.text_input(key="runs_tag").set_value("x")
    _ok(at.run())  # was IndexError: positions 1 and 2 of a 2-row frame
    assert at.multiselect(key="runs_selected").value == [third]
    assert any(f"#{second} left the selection" in w.value for w in at.warning)
    at.text_input(key="act_tags").set_value("picked")
    at.button(key="act_tag_apply").click()
    _ok(at.run())
    from db import queries

    assert {i: queries.get_experiment(_engine(), i)["tags"] for i in (first, second, third)} == {
        first: ["x"], second: ["y"], third: ["picked"]}


def test_compare_keeps_requested_runs_beyond_the_recent_list(monkeypatch):
    from dashboard import compare_view

    monkeypatch.setattr(compare_view, "RECENT_RUNS", 2, raising=False)
    old, *_ = [_submit(s, []) for s in ("ddp", "zero2", "zero3")]
    at = AppTest.from_file(APP, default_timeout=30).run()
    at.session_state["compare_ids"] = [old, old + 2, 999]
    _ok(at.switch_page("dashboard/pages/compare.py").run())
    assert at.multiselect(key="compare_pick").value == [old, old + 2], "a run outside the recent list is still compared"
    assert list(at.dataframe[0].value.columns) == [f"#{old}", f"#{old + 2}"]
    assert any("#999 left the selection" in w.value for w in at.warning)


def _plan_search(at: AppTest, gpus: int) -> AppTest:
    from dashboard import spec_form as sf

    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2"))
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(gpus)
    at.number_input(key="pl_batch").set_value(32)
    at.button(key="pl_go").click()
    return _ok(at.run())


@pytest.mark.heavy
def test_plan_new_search_does_not_inherit_the_ticked_row():
    at = _ok(AppTest.from_file(APP, default_timeout=120).run().switch_page("dashboard/pages/plan.py").run())
    _plan_search(at, 8)
    _tick(at, [2])
    assert not at.button(key="pl_open").disabled
    _plan_search(at, 16)
    assert at.button(key="pl_open").disabled, "row 3 of the old search must not select row 3 of the new one"
