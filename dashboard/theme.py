"""Shared colours and labels so every chart names a category the same way."""

from __future__ import annotations

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes")
CATEGORY_LABEL = {
    "params_bytes": "parameters",
    "grads_bytes": "gradients",
    "optimizer_bytes": "optimizer state",
    "activations_bytes": "activations",
    "other_bytes": "other",
}
CATEGORY_COLOR = {
    "params_bytes": "#4C78A8",
    "grads_bytes": "#F58518",
    "optimizer_bytes": "#54A24B",
    "activations_bytes": "#E45756",
    "other_bytes": "#9D9D9D",
}
PASS_COLOR = {"F": "#4C78A8", "B": "#E45756", "W": "#54A24B", "send": "#BAB0AC", "recv": "#BAB0AC"}
STRATEGY_COLOR = {
    "ddp": "#4C78A8", "zero1": "#F58518", "zero2": "#54A24B", "zero3": "#E45756",
    "fsdp": "#B279A2", "tp": "#72B7B2", "pp": "#EECA3B", "ep": "#9D755D",
}
STATUS_ICON = {
    "queued": ":material/schedule:", "running": ":material/play_circle:", "ok": ":material/check_circle:",
    "failed": ":material/error:", "timeout": ":material/timer_off:", "oom": ":material/memory:",
    "cancelled": ":material/cancel:", "interrupted": ":material/warning:",
}
# No template: st.plotly_chart applies the Streamlit theme, and setting a template costs ~130 ms per figure.
# The legend stands right of the plot, where plotly makes room for it: below it, it covered rotated tick labels.
LAYOUT = dict(margin=dict(l=60, r=20, t=50, b=50),
              legend=dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top"))
