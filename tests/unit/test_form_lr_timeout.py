"""The New-experiment form sets the learning rate and the run's timeout (`--lr`, `--timeout` on the CLI): before, it
had no widget for either, so every run from the form trained at lr 1e-3 and was killed after 600 s, and a loaded spec's
values were invisible."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from backend.spec import validate_spec

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TINY = {"model": {"vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1, "lr": 3e-4},
        "parallel": {"strategy": "ddp", "world_size": 2}, "runtime": {"timeout_s": 0.5}}


def _app(tmp_path, monkeypatch, clone=None) -> AppTest:
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()
    at = AppTest.from_file(APP, default_timeout=60)
    if clone is not None:
        at.session_state["clone_spec"] = clone
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _stored(tmp_path, eid: int):
    from db import queries
    from db.session import open_db

    return queries.get_experiment(open_db(f"sqlite:///{tmp_path / 'ui.db'}"), eid)["spec"]


def test_the_form_sets_learning_rate_and_timeout(tmp_path, monkeypatch):
    at = _app(tmp_path, monkeypatch)
    at.number_input(key="f_lr").set_value(0.01)
    at.number_input(key="f_timeout_s").set_value(1800.0)
    at.button(key="submit_one").click().run()
    assert not at.exception, [e.message for e in at.exception]
    spec = _stored(tmp_path, 1)
    assert spec.train.lr == 0.01 and spec.runtime.timeout_s == 1800.0


def test_edit_as_new_shows_the_loaded_values_even_a_sub_second_timeout(tmp_path, monkeypatch):
    spec, problems = validate_spec(TINY)
    assert not problems, problems
    at = _app(tmp_path, monkeypatch, clone=spec)
    assert at.number_input(key="f_lr").value == 3e-4
    assert at.number_input(key="f_timeout_s").value == 0.5
    at.number_input(key="f_lr").set_value(0.0).run()
    assert any("lr" in e.value for e in at.error), "lr 0 is refused with the reason, not a traceback"
