"""Run-detail figures and tables: measured vs predicted memory, comm per collective, loss, step time."""

from __future__ import annotations

import statistics
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.number_format import fmt_bytes, fmt_pct, fmt_seconds
from backend.result import MEMORY_CATEGORIES, PARITY_FAILS, RunResult, error_pct, parity_verdict
from dashboard.predict_view import byte_scale, coords_label
from dashboard.theme import CATEGORY_COLOR, CATEGORY_LABEL, LAYOUT

CATS = MEMORY_CATEGORIES + ("other_bytes",)


def measured_anything(result: RunResult) -> bool:
    """Whether any rank recorded measurements (a run that failed before measuring keeps only its prediction)."""
    return any(r.step_s or r.comm or any(getattr(r.measured, c) for c in CATS + ("peak_bytes",))
               for r in result.per_rank)


def log_tail_of(run: dict[str, Any], runs_dir: Any, lines: int = 40) -> tuple[str | None, str]:
    """(log tail, where it came from): the stored tail, else the end of the run folder's log.txt."""
    res = run.get("result")
    tail = run.get("log_tail") or (res.log_tail if res is not None else None)
    if tail:
        return tail, "stored with the run"
    path = runs_dir / str(run["id"]) / "log.txt"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None, f"no log was stored and {path} does not exist"
    return ("\n".join(text.splitlines()[-lines:]) or None), f"last {lines} lines of {path}"


def measured_vs_predicted_fig(result: RunResult) -> go.Figure:
    """Stacked bars per category, measured beside predicted for every rank (x = rank / source)."""
    ranks = result.per_rank
    peak = max([sum(getattr(r.measured, c) for c in CATS) for r in ranks]
               + [sum(getattr(r.predicted, c) for c in CATS) for r in ranks] + [1])
    div, unit = byte_scale(peak)
    x0 = [f"rank {r.rank}" for r in ranks for _ in (0, 1)]
    x1 = ["measured", "predicted"] * len(ranks)
    fig = go.Figure()
    for c in CATS:
        vals = [getattr(src, c) for r in ranks for src in (r.measured, r.predicted)]
        if not any(vals):
            continue
        errs = [_err_text(r, c) for r in ranks for _ in (0, 1)]
        fig.add_bar(
            name=CATEGORY_LABEL[c], x=[x0, x1], y=[v / div for v in vals], marker_color=CATEGORY_COLOR[c],
            customdata=[[fmt_bytes(v), e] for v, e in zip(vals, errs, strict=False)],
            hovertemplate=f"%{{x}}<br>{CATEGORY_LABEL[c]}: %{{y:.3f}} {unit} (%{{customdata[0]}})<br>error vs "
                          "prediction: %{customdata[1]}<extra></extra>",
        )
    fig.update_layout(barmode="stack", title="Memory per rank at the step's peak: measured vs predicted",
                      xaxis_title="rank / source", yaxis_title=f"memory ({unit})", **LAYOUT)
    return fig


def _err_text(r: Any, c: str) -> str:
    e = (r.error_pct or {}).get(c)
    if e is None:
        e = error_pct(getattr(r.measured, c), getattr(r.predicted, c))
    return fmt_pct(e)


def memory_error_frame(result: RunResult) -> pd.DataFrame:
    """Per rank and category: measured, predicted, error; a run that did not finish ok measured no category
    (RunResult.memory_measured: its zeros mean unknown), so those cells are blank."""
    rows, measured = [], result.memory_measured
    for r in result.per_rank:
        row: dict[str, Any] = {"rank": r.rank, "coords": coords_label(r.coords)}
        for c in MEMORY_CATEGORIES:
            m, p = getattr(r.measured, c) if measured else None, getattr(r.predicted, c)
            row[f"{CATEGORY_LABEL[c]} measured"] = fmt_bytes(m)
            row[f"{CATEGORY_LABEL[c]} predicted"] = fmt_bytes(p)
            e = (r.error_pct or {}).get(c, error_pct(m, p)) if measured else None
            row[f"{CATEGORY_LABEL[c]} error"] = fmt_pct(e)
        row["peak measured"] = fmt_bytes(r.measured.peak_bytes if measured else None)
        if r.cuda_max_allocated_bytes is not None or r.cuda_max_reserved_bytes is not None:
            # the caching allocator's view: reserved - allocated = cached blocks and fragmentation
            row["CUDA max allocated"] = fmt_bytes(r.cuda_max_allocated_bytes)
            row["CUDA max reserved"] = fmt_bytes(r.cuda_max_reserved_bytes)
        rows.append(row)
    return pd.DataFrame(rows)


def routing_frame(result: RunResult) -> pd.DataFrame:
    """EP runs: per rank, the routing measured and the formula fed that routing next to the uniform-routing one."""
    rows = []
    for r in result.per_rank:
        g = r.predicted_given_routing
        if g is None:
            continue
        a2a = r.comm["all_to_all"].bytes if "all_to_all" in r.comm else 0.0
        act = r.measured.activations_bytes
        rows.append({
            "rank": r.rank, "coords": coords_label(r.coords),
            "token-slots received": f"{g.received_token_slots:,} "
                                    f"({g.received_token_slots / g.uniform_token_slots:.2f}× uniform)"
            if g.uniform_token_slots else f"{g.received_token_slots:,}",
            "activations measured": fmt_bytes(act),
            "vs uniform routing": fmt_pct(error_pct(act, r.predicted.activations_bytes)),
            "vs measured routing": fmt_pct(error_pct(act, g.activations_bytes)),
            "all_to_all measured": fmt_bytes(a2a),
            "a2a vs uniform": fmt_pct(error_pct(a2a, r.comm_predicted.get("all_to_all", 0.0))),
            "a2a vs measured routing": fmt_pct(error_pct(a2a, g.all_to_all_bytes)),
        })
    return pd.DataFrame(rows)


def comm_frame(result: RunResult) -> pd.DataFrame:
    """Per collective, averaged over ranks: measured calls/payload/wire/time per step vs analytic payload."""
    colls = sorted({k for r in result.per_rank for k in list(r.comm) + list(r.comm_predicted)})
    rows = []
    n = max(len(result.per_rank), 1)
    for k in colls:
        stats = [r.comm.get(k) for r in result.per_rank]
        # mean is called only within this iteration, so it sees this collective's stats
        mean = lambda f: sum(getattr(s, f) for s in stats if s is not None) / n  # noqa: E731, B023
        timed = [s.seconds for s in stats if s is not None and s.seconds is not None]
        untimed = any(s is not None and s.seconds is None for s in stats)
        pred = sum(float(r.comm_predicted.get(k, 0) or 0) for r in result.per_rank) / n
        meas = mean("bytes")
        rows.append({
            "collective": k, "calls / step": round(mean("calls"), 2),
            "measured payload / step": fmt_bytes(meas), "predicted payload / step": fmt_bytes(pred),
            "error": fmt_pct(error_pct(meas, pred)), "measured wire / step": fmt_bytes(mean("wire_bytes")),
            # None: not measurable on this backend (NCCL functional collectives, see CommStat.seconds_note)
            "time in collective / step": "n/a" if untimed else fmt_seconds(sum(timed) / n),
        })
    return pd.DataFrame(rows)


def comm_caption(result: RunResult) -> str:
    """What the comm table's time column means on this run's backend (backend/bench/comm.py)."""
    head = "Payload = the buffer handed to the collective; wire = what a ring algorithm sends per rank. "
    tail = (", averaged over up to 3 comm-timing steps run after the timed ones, so counting never slows the timed "
            "steps.")
    if (result.env or {}).get("backend") == "nccl":
        notes = sorted({c.seconds_note for r in result.per_rank for c in r.comm.values() if c.seconds_note})
        return (head + "Time = the collective's own duration on NCCL's stream (CUDA events, Work._get_duration)" + tail
                + (" n/a: " + "; ".join(notes) + "." if notes else ""))
    return (head + "Time = issue to completion (incl. waiting for peers; overlapping collectives each count their "
            "span)" + tail)


def loss_fig(result: RunResult) -> go.Figure | None:
    if not result.loss and not result.loss_reference:
        return None
    fig = go.Figure()
    if result.loss:
        fig.add_scatter(name=f"{result.spec.parallel.strategy} (world {result.spec.parallel.world_size})",
                        y=result.loss, x=list(range(1, len(result.loss) + 1)), mode="lines+markers",
                        hovertemplate="step %{x}: loss %{y:.6f}<extra></extra>")
    if result.loss_reference:
        fig.add_scatter(name="single-process reference", y=result.loss_reference,
                        x=list(range(1, len(result.loss_reference) + 1)), mode="lines+markers", line_dash="dash",
                        hovertemplate="step %{x}: reference loss %{y:.6f}<extra></extra>")
    sub = f" (max |Δ| = {result.loss_max_abs_diff:.2e})" if result.loss_max_abs_diff is not None else ""
    fig.update_layout(title="Training loss vs single-process reference" + sub, xaxis_title="step",
                      yaxis_title="cross-entropy loss (nats)", **LAYOUT)
    fig.update_xaxes(dtick=1)
    return fig


def step_time_fig(result: RunResult) -> go.Figure | None:
    if not any(r.step_s for r in result.per_rank):
        return None
    fig = go.Figure()
    for r in result.per_rank:
        if r.step_s:
            fig.add_scatter(name=f"rank {r.rank}", x=list(range(1, len(r.step_s) + 1)), y=[s * 1e3 for s in r.step_s],
                            mode="lines+markers",
                            hovertemplate=f"rank {r.rank} step %{{x}}: %{{y:.1f}} ms<extra></extra>")
    fig.update_layout(title="Wall time of each timed step", xaxis_title="timed step", yaxis_title="step time (ms)",
                      **LAYOUT)
    fig.update_xaxes(dtick=1)
    return fig


def headline(result: RunResult) -> dict[str, str]:
    steps = [s for r in result.per_rank for s in r.step_s]
    med = result.step_s_median if result.step_s_median is not None else (statistics.median(steps) if steps else None)
    peak = max((r.measured.peak_bytes for r in result.per_rank), default=None)
    return {
        "step time (median)": fmt_seconds(med),
        "tokens / s": f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "–",
        "peak memory (max rank)": fmt_bytes(peak),
        "loss max |Δ| vs reference": _parity_cell(result),
        **_skipped(result),
        "wall time": fmt_seconds(result.wall_s),
        "achieved FLOP/s (MFU · HFU)": (f"{result.achieved_flops:.3g}".replace("e+", "e") if result.achieved_flops
                                        else "–")
        + _utilization(result),
    }


HEADLINE_HELP = {
    "achieved FLOP/s (MFU · HFU)": ("Model FLOPs executed per second. MFU: model FLOPs utilization, model FLOPs (no "
                                    "recompute) per second / the devices' peak; HFU: hardware FLOPs utilization, the "
                                    "same with the recomputed forward passes counted. Blank where the device's peak is "
                                    "not known (CPU ranks)."),
    "loss max |Δ| vs reference": "Largest difference of the per-step loss from a single-process run of the same model, "
                                 "seed and data: 0 up to float rounding when the sharding is right.",
    "peak memory (max rank)": "True peak of the tracked bytes in the step on the fullest rank.",
}


def _parity_cell(result: RunResult) -> str:
    diff = result.loss_max_abs_diff
    if diff is None:
        return "–"
    precision = str(result.spec.train.precision)
    fails = parity_verdict(precision, diff) == PARITY_FAILS
    return f"{diff:.2e}" + (" ⚠ fails" if fails else "")  # the bound is in the warning above: a metric cuts long text


def _skipped(result: RunResult) -> dict[str, str]:
    """fp16-mixed runs: how many optimizer steps the loss scaler skipped (inf/NaN gradients on some rank)."""
    skipped = getattr(result, "loss_scaling_skipped_steps", None)
    return {} if skipped is None else {"fp16 steps skipped (overflow)": f"{len(skipped)}"
                                       + (f" {skipped}" if skipped else "")}


def _utilization(result: RunResult) -> str:
    """MFU (model FLOPs) next to HFU (recompute included); blank where the device's peak is unknown."""
    hfu = getattr(result, "hfu", None)
    if result.mfu is None and hfu is None:
        return ""
    parts = [f"MFU {result.mfu * 100:.1f} %" if result.mfu is not None else "MFU –",
             f"HFU {hfu * 100:.1f} %" if hfu is not None else "HFU –"]
    return f" ({' · '.join(parts)})"
