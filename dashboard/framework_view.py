"""Issue 14 panels: a framework's own estimate beside ShardLab's, DeepSpeed's model states, torch offload's
host/device split, XLA's collectives; and the "same model, same strategy, three frameworks" comparison."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.number_format import fmt_bytes, fmt_pct, fmt_seconds
from backend.result import MEMORY_CATEGORIES, RunResult, error_pct
from dashboard.theme import CATEGORY_COLOR, CATEGORY_LABEL, LAYOUT

ESTIMATE_COLUMN = "DeepSpeed's estimate"


def model_state_frame(result: RunResult) -> pd.DataFrame:
    """Per rank: model states measured, ShardLab's prediction for the framework's layout, and the framework's own
    estimate as an extra column where it has one. Empty for runs without them."""
    rows = []
    for r in result.per_rank:
        m, p, est = r.model_states_measured, r.model_states_predicted, r.framework_estimate
        if m is None and est is None:
            continue
        row: dict[str, Any] = {"rank": r.rank}
        if m is not None and p is not None:
            row.update({"params": fmt_bytes(m.params_bytes), "fp32 master": fmt_bytes(m.master_bytes),
                        "optimizer state": fmt_bytes(m.optimizer_state_bytes),
                        "model states measured": fmt_bytes(m.total_bytes),
                        "ShardLab predicted": fmt_bytes(p.total_bytes),
                        "error": fmt_pct(error_pct(m.total_bytes, p.total_bytes))})
        if est is not None:
            row[ESTIMATE_COLUMN] = fmt_bytes(est.device_bytes)
            row["its error"] = fmt_pct(error_pct(m.total_bytes, est.device_bytes)) if m is not None else "—"
            row["estimate (host)"] = fmt_bytes(est.host_bytes)
        rows.append(row)
    return pd.DataFrame(rows)


def offload_frame(result: RunResult) -> pd.DataFrame:
    rows = []
    for r in result.per_rank:
        o = r.offload
        if o is None:
            continue
        rows.append({"rank": r.rank, "host measured": fmt_bytes(o.host_bytes_measured),
                     "host predicted": fmt_bytes(o.host_bytes_predicted),
                     "host error": fmt_pct(error_pct(o.host_bytes_measured, o.host_bytes_predicted)),
                     "device measured": fmt_bytes(o.device_bytes_measured),
                     "device predicted": fmt_bytes(o.device_bytes_predicted),
                     "device error": fmt_pct(error_pct(o.device_bytes_measured, o.device_bytes_predicted))})
    return pd.DataFrame(rows)


def xla_collectives_frame(result: RunResult) -> pd.DataFrame:
    coll = (result.framework_facts or {}).get("collectives", {})
    return pd.DataFrame([{"collective": k, "count per step": v.get("calls"),
                          "payload per device": fmt_bytes(v.get("bytes", 0)),
                          "group sizes": ", ".join(map(str, v.get("group_sizes", []))) or "—"}
                         for k, v in coll.items()])


def three_frameworks_frame(results: list[tuple[int, RunResult]]) -> pd.DataFrame:
    """One column per run: framework, model states / activations per rank (max over ranks), comm bytes, step time."""
    cols: dict[str, dict[str, str]] = {}
    for rid, res in results:
        s = res.spec
        col: dict[str, str] = {"framework": str(s.framework), "strategy": str(s.parallel.strategy),
                               "world": str(s.parallel.world_size), "offload": str(s.parallel.offload)}
        unknown = _unmeasured(res)
        for c in MEMORY_CATEGORIES:
            col[CATEGORY_LABEL[c]] = unknown or fmt_bytes(max((getattr(r.measured, c) for r in res.per_rank),
                                                              default=0))
        col["comm bytes / step / rank"] = unknown or fmt_bytes(_comm_bytes(res))
        col["step time (median)"] = fmt_seconds(res.step_s_median) if res.step_s_median else "—"
        col["loss parity"] = f"{res.loss_max_abs_diff:.2g}" if res.loss_max_abs_diff is not None else "—"
        cols[f"#{rid} {s.framework}"] = col
    return pd.DataFrame(cols)


def _unmeasured(res: RunResult) -> str | None:
    """The cell for a run without per-category measurements (its zero defaults mean unknown, not 0 B); None if it
    has them. An imported run's log gives allocator peaks only (RunResult.memory_measured)."""
    if res.memory_measured:
        return None
    return "– (not in the log)" if res.imported is not None else "– (not measured)"


def _comm_bytes(res: RunResult) -> float:
    return max((sum(c.bytes for c in r.comm.values()) for r in res.per_rank), default=0.0)


def three_frameworks_fig(results: list[tuple[int, RunResult]]) -> go.Figure:
    """Memory by category (max over ranks), one stacked bar per run, labelled with its framework."""
    fig = go.Figure()
    results = [(rid, res) for rid, res in results if res.memory_measured]  # no zero bars for what was not measured
    x = [f"#{rid} {res.spec.framework}" for rid, res in results]
    for c in MEMORY_CATEGORIES:
        fig.add_bar(name=CATEGORY_LABEL[c], x=x, marker_color=CATEGORY_COLOR[c],
                    y=[max((getattr(r.measured, c) for r in res.per_rank), default=0) / 2**20 for _, res in results])
    fig.update_layout(barmode="stack", title="Same model, same strategy: memory by category per framework",
                      yaxis_title="MiB (max over ranks)", **LAYOUT)
    return fig


def same_model_and_strategy(results: list[tuple[int, RunResult]]) -> str | None:
    """None when the runs share model shape and strategy; else what differs (the comparison is only fair then)."""
    keys = {(r.spec.model.model_dump_json(), str(r.spec.parallel.strategy)) for _, r in results}
    return None if len(keys) <= 1 else ("these runs differ in model shape or strategy: the comparison mixes more than "
                                        "the framework")
