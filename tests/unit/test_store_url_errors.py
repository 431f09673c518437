"""A store URL that cannot work (not a URL, an unknown database or a driver not installed, a SQLite folder that
cannot be created, a folder given as the file) is refused in words: the CLI exits 2 with the reason, the dashboard
shows it on every page. Before, each was a traceback, on every page of the dashboard."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.cli import main

APP = str(Path(__file__).resolve().parents[2] / "app.py")
BAD = {
    "not a URL": ("no-such-scheme", "cannot be opened"),
    "unknown database": ("foo://bar", "cannot be opened"),
    "driver not installed": ("postgresql+nosuchdriver://user:secret@host/db", "cannot be opened"),
    "folder cannot be created": ("sqlite:////proc/no/such/dir/s.db", "cannot create the SQLite store"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_cli_refuses_a_store_url_in_words(case, capsys):
    url, words = BAD[case]
    assert main(["list", "--db", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err
    assert "secret" not in err, "the message never quotes the URL's password"


def test_a_folder_given_as_the_store_file_is_refused(tmp_path, capsys):
    assert main(["list", "--db", f"sqlite:///{tmp_path}"]) == 2
    assert "is a folder, not a database file" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["not a URL", "folder cannot be created"])
def test_the_dashboard_says_why_the_store_cannot_be_used(case, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", BAD[case][0])
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    for page in (None, "dashboard/pages/runs.py"):
        if page:
            at.switch_page(page).run()
        assert not at.exception, [e.message for e in at.exception]
        assert any("The experiment store cannot be used" in e.value and BAD[case][1] in e.value for e in at.error)


def test_a_store_removed_while_the_dashboard_runs_is_said_in_words(tmp_path, monkeypatch):
    import streamlit as st

    db = tmp_path / "s.db"
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{db}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and not at.error
    db.rename(tmp_path / "moved.db")
    st.cache_data.clear()
    at.switch_page("dashboard/pages/runs.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("The experiment store cannot be used" in e.value and "was removed" in e.value for e in at.error)
