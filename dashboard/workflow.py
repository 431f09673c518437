"""The workflow in one line, on the home page: Plan -> New experiment -> Run -> Compare."""

from __future__ import annotations

import streamlit as st

STEPS = (("dashboard/pages/plan.py", "1 · Plan", ":material/travel_explore:",
          "find the layouts of a model that fit a cluster, fastest first"),
         ("dashboard/pages/new_experiment.py", "2 · New experiment", ":material/science:",
          "check one: memory and step time per rank"),
         ("dashboard/pages/runs.py", "3 · Run", ":material/play_arrow:", "measure it on real ranks here (scaled down)"),
         ("dashboard/pages/compare.py", "4 · Compare", ":material/bar_chart:",
          "measured next to predicted, runs side by side"))


def steps() -> None:
    """Four page links in a row, each with what it is for (plain labels when a page runs outside app.py's
    navigation)."""
    from streamlit.errors import StreamlitAPIException

    for col, (page, label, icon, what) in zip(st.columns(len(STEPS)), STEPS, strict=False):
        try:
            col.page_link(page, label=label, icon=icon, help=what)
        except StreamlitAPIException:
            col.text(label)
        col.caption(what)
