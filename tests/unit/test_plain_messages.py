"""User text inside messages is shown as typed (issue 30 item 8): a validation problem that quotes a run name with
`**bold**` and `$E=mc^2$` rendered bold and a typeset formula in "This spec cannot run". Messages put the user's
text in code spans (dashboard/messages.py); the browser test proves the rendering
(tests/e2e/test_browser_plain_and_state.py), this one the markdown handed to Streamlit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard.messages import code_span

APP = str(Path(__file__).resolve().parents[2] / "app.py")
NAME = "**bold** $E=mc^2$ [link](http://x.example) " * 5


def _unspan(markdown: str) -> list[str]:
    """The code spans' contents, as CommonMark reads them (delimiter run, one padding space each side)."""
    return [m.group(2) for m in re.finditer(r"(`+) (.*?) \1(?!`)", markdown, re.S)]


@pytest.mark.parametrize("text", ["**bold** $E=mc^2$", "a `tick` and ``two``", "`starts", "ends`", "www.x.example",
                                  ":red[alert] :material/home:"])
def test_a_code_span_holds_any_text_verbatim(text):
    span = code_span(text)
    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    assert span.startswith("`" * (longest + 1) + " ") and _unspan(span) == [text]


@pytest.fixture
def ui(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")


def test_this_spec_cannot_run_quotes_the_name_as_code(ui):
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.text_input(key="f_name").set_value(NAME).run()
    assert not at.exception
    (box,) = [e.value for e in at.error if e.value.startswith("This spec cannot run:")]
    head, _, items = box.partition("\n\n")
    assert head == "This spec cannot run:" and items.startswith("- `")
    (problem,) = _unspan(items)
    assert problem.startswith("name: String should have at most 200 characters (got '**bold** $E=mc^2$ [link](")
    assert box.count("**bold**") == problem.count("**bold**")  # nowhere outside the code span
