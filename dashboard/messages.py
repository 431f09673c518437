"""Messages that carry the user's text (names, tags, file names, validation problems that quote them, what an uploaded
config said), shown as typed, never as markdown. In an alert box, a name like `**bold** $E=mc^2$` rendered bold and as
a typeset formula, and a URL became a link; backslash escapes do not stop autolinks (issue 21). Inside a code span
markdown interprets nothing: `box` lists the user's lines as code spans under our own words, in the same box (a code
span wraps with the box; a fenced block would scroll a long name out of sight)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import streamlit as st


def code_span(text: str) -> str:
    """`text` as a markdown code span shown verbatim: delimited by more backticks than any run in it, padded with one
    space each side, which CommonMark strips again (so a text that starts or ends with a backtick survives too)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    tick = "`" * (longest + 1)
    return f"{tick} {text} {tick}"


def box(kind: str, head: str, lines: Iterable[str], *, icon: str | None = None, where: Any = None) -> None:
    """st.error / st.warning / st.info: `head` (fixed words, no user text), then each of `lines` verbatim, one list
    item each (a line's own newlines become spaces, as in any code span)."""
    items = "\n".join(f"- {code_span(line)}" for line in lines)
    getattr(where if where is not None else st, kind)(f"{head}\n\n{items}" if items else head, icon=icon)


def note(text: str, *, where: Any = None) -> None:
    """A side note that may quote the user's text (the notes of an uploaded config.json): ⓘ and plain text."""
    (where if where is not None else st).text(f"ⓘ {text}")
