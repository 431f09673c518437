"""The Formulas page's "Published runs" tab: the model against every published training run of the stacks users train
with (backend/analytic/steptime/published_check.py; `python -m backend published` is its scriptable twin)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.steptime.published_check import (
    STEP_MEAN_TARGET_PCT,
    STEP_WORST_TARGET_PCT,
    RowCheck,
    StackSummary,
)
from dashboard.theme import LAYOUT

TARGET_LABEL = {True: "met", False: "not met", None: "no target"}


def summary_frame(sums: list[StackSummary]) -> pd.DataFrame:
    """One line per stack and GPU: the step's errors against the target, and memory where the sources give it."""
    return pd.DataFrame([{
        "stack": s.stack, "GPU": s.hardware + (" (MoE)" if s.moe else ""), "rows": s.step.rows,
        "step mean |error| %": round(s.step.mean_abs_pct, 1), "step mean error %": round(s.step.mean_pct, 1),
        "step worst |error| %": round(s.step.worst_pct, 1),
        f"target (mean <= {STEP_MEAN_TARGET_PCT:g}%, worst <= {STEP_WORST_TARGET_PCT:g}%)":
            TARGET_LABEL[s.step_target_met],
        "fit the GPU": f"{s.fits}/{s.fit_rows}" + (f" (+{s.tight} tight)" if s.tight else ""),
        "fullest <= published peak": (f"{s.fullest_under_published}/{s.reserved.rows}" if s.reserved else None),
        "reserved mean |error| %": round(s.reserved.mean_abs_pct, 1) if s.reserved else None,
    } for s in sums])


def rows_frame(checks: list[RowCheck]) -> pd.DataFrame:
    """One line per published run: its layout and source, published against predicted."""
    out = []
    for c in checks:
        m = c.memory
        out.append({"run": c.row.id, "stack": c.row.stack, "GPU": c.row.hardware, "layout": c.row.layout,
                    "published step s": round(c.row.step_s, 3), "predicted step s": round(c.predicted_step_s, 3),
                    "error %": round(c.step_error_pct, 1), "published peak GiB": c.row.memory_gib,
                    "predicted fullest GiB": round(m.fullest_gib, 1) if m else None,
                    "predicted reserved GiB": round(m.reserved_gib, 1) if m else None,
                    "fit": m.verdict if m else None, "step time assumes": "; ".join(c.caveats),
                    "source": c.row.source, "link": c.row.url})
    return pd.DataFrame(out)


def error_fig(checks: list[RowCheck]) -> go.Figure:
    """Predicted against published step time, one colour per stack, with the diagonal and the +/-15% band."""
    fig = go.Figure()
    for stack in dict.fromkeys(c.row.stack for c in checks):
        mine = [c for c in checks if c.row.stack == stack]
        labels = [f"{c.row.id}<br>{c.row.hardware}: {c.step_error_pct:+.1f}%" for c in mine]
        fig.add_scatter(name=stack, x=[c.row.step_s for c in mine], y=[c.predicted_step_s for c in mine],
                        mode="markers", text=labels,
                        hovertemplate="%{text}<br>published %{x:.3f} s, predicted %{y:.3f} s<extra></extra>")
    if checks:
        lo = min(min(c.row.step_s, c.predicted_step_s) for c in checks) * 0.8
        hi = max(max(c.row.step_s, c.predicted_step_s) for c in checks) * 1.25
        for factor, dash, name in ((1.0, "solid", "predicted = published"),
                                   (1 + STEP_WORST_TARGET_PCT / 100, "dot", f"+{STEP_WORST_TARGET_PCT:g}%"),
                                   (1 - STEP_WORST_TARGET_PCT / 100, "dot", f"-{STEP_WORST_TARGET_PCT:g}%")):
            fig.add_scatter(name=name, x=[lo, hi], y=[lo * factor, hi * factor], mode="lines",
                            line=dict(color="gray", dash=dash), hoverinfo="skip")
    fig.update_layout(title="Predicted against published step time (each run through its own spec)",
                      xaxis_title="published step (s, log)", yaxis_title="predicted step (s, log)", **LAYOUT)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig
