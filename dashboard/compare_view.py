"""Compare runs side by side and plot scaling: measured points over analytic curves."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.units import MiB
from backend.number_format import fmt_bytes, fmt_frac, fmt_seconds
from backend.result import RunResult
from backend.spec import ExperimentSpec, Strategy, dims, validate_spec
from dashboard.theme import LAYOUT, STRATEGY_COLOR

CATS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
RECENT_RUNS = 500
"""The picker lists this many newest runs, plus any run the Runs page sent over."""


def _max_rank(result: RunResult, which: str, cat: str | None = None) -> float:
    vals = [sum(getattr(getattr(r, which), c) for c in ([cat] if cat else CATS)) for r in result.per_rank]
    return float(max(vals, default=0))


def _predicted_text(result: RunResult) -> str:
    """The fullest rank's predicted bytes; a JAX run's prediction has no activations (XLA reports them only as its
    temp buffer, backend/frameworks/assemblers.py), so the cell says so beside a measured total that has them."""
    text = fmt_bytes(_max_rank(result, "predicted"))
    return text + " + activations (not predicted for XLA)" if str(result.spec.framework) == "jax" else text


def _comm_total(result: RunResult) -> float:
    return max((sum(s.bytes for s in r.comm.values()) for r in result.per_rank), default=0.0)


_LABELLED = ("dp", "tp", "pp", "ep", "cp")
"""The degrees the "degrees" row names itself; any other dimension above 1 is appended (backend/spec/dims.py)."""


def compare_frame(runs: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows = properties, columns = '#id name'. `runs` are get_experiment dicts (spec, result, status)."""
    cols: dict[str, dict[str, str]] = {}
    for e in runs:
        s: ExperimentSpec = e["spec"]
        res: RunResult | None = e.get("result")
        p, t, m = s.parallel, s.train, s.model
        col = {
            "status": str(e.get("status")),
            "framework / offload": f"{s.framework} / {p.offload}",  # issue 14
            "strategy": str(p.strategy), "world size": str(p.world_size),
            "degrees dp×tp×pp (ep)": f"{p.dp}×{p.tp}×{p.pp} ({p.ep})" + (f" cp{p.cp} {p.cp_rotate}" if p.cp > 1 else "")
            + "".join(f" {x}" for x in dims.unnamed_parts(dims.DIMS, p.degrees(), _LABELLED)),
            "pp schedule / microbatches": f"{p.pp_schedule if p.pp > 1 else '–'} / {t.microbatches}",
            "model h×L, heads, seq": f"{m.d_model}×{m.n_layers}, {m.n_heads}, {m.seq_len}",
            "precision / optimizer / recompute": f"{t.precision} / {t.optimizer} / {t.recompute}",
            "global batch / steps": f"{t.global_batch} / {t.steps}",
        }
        imported = getattr(res, "imported", None) if res is not None else None
        if imported is not None:  # issue 25: measured elsewhere; its log gives allocator peaks, no categories
            col.update({
                "source": f"imported from {imported.framework} ({imported.gpus} GPUs)",
                "step time (median)": fmt_seconds(res.step_s_median),
                "tokens / s": f"{res.tokens_per_s:,.0f}" if res.tokens_per_s else "–",
                "memory, fullest rank: measured": f"peak allocated {fmt_bytes(imported.peak_allocated_bytes)}, "
                                                  f"reserved {fmt_bytes(imported.peak_reserved_bytes)} (log)",
                "memory, fullest rank: predicted": fmt_bytes(_max_rank(res, "predicted")),
                **{f"{c.removesuffix('_bytes')} (fullest rank, measured)": "– (not in the log)" for c in CATS},
            })
        elif res is not None and res.per_rank:
            col.update({
                "step time (median)": fmt_seconds(res.step_s_median),
                "tokens / s": f"{res.tokens_per_s:,.0f}" if res.tokens_per_s else "–",
                "memory, fullest rank: measured": fmt_bytes(_max_rank(res, "measured")),
                "memory, fullest rank: predicted": _predicted_text(res),
                **{f"{c.removesuffix('_bytes')} (fullest rank, measured)": fmt_bytes(_max_rank(res, "measured", c))
                   for c in CATS},
                "comm payload / step (busiest rank)": fmt_bytes(_comm_total(res)),
                "bubble measured / predicted": f"{fmt_frac(res.bubble_measured)} / {fmt_frac(res.bubble_predicted)}",
                "loss max |Δ| vs reference": (f"{res.loss_max_abs_diff:.2e}" if res.loss_max_abs_diff is not None
                                              else "–"),
            })
        cols[f"#{e['id']} {s.name}".strip()] = col
    return pd.DataFrame(cols)


def highlight_differences(df: pd.DataFrame) -> pd.DataFrame:
    """A same-shaped frame of CSS: cells that differ from the first run's value are highlighted."""
    styles = pd.DataFrame("", index=df.index, columns=df.columns)
    if df.shape[1] < 2:
        return styles
    first = df.iloc[:, 0]
    for c in df.columns[1:]:
        styles.loc[df[c] != first, c] = "background-color: #fff3b0; font-weight: 600"
    return styles


def _with_world(spec: ExperimentSpec, world: int) -> ExperimentSpec | None:
    d = spec.model_dump(mode="json")
    p = d["parallel"]
    p["world_size"], p["dp"] = world, None
    if spec.parallel.strategy in (Strategy.TP, Strategy.PP, Strategy.EP):
        p[str(spec.parallel.strategy)] = 1
    d["train"]["microbatches"] = None
    d["train"]["global_batch"] = spec.train.micro_batch * spec.train.microbatches * max(world // (p["tp"] * p["pp"]), 1)
    out, _ = validate_spec(d, predict_only=True)
    return out


def analytic_curve(spec: ExperimentSpec, worlds: list[int]) -> tuple[list[int], list[float]]:
    """Predicted fullest-rank bytes (params+grads+optimizer+activations) as the world grows, shape fixed."""
    from backend.analytic.estimate import estimate

    xs, ys = [], []
    for w in worlds:
        s = _with_world(spec, w)
        if s is None:
            continue
        est = estimate(s)
        xs.append(w)
        ys.append(max(sum(float(getattr(r, c)) for c in CATS) for r in est.per_rank))
    return xs, ys


def memory_scaling_fig(runs: list[dict[str, Any]]) -> go.Figure:
    """Per series (runs that differ only in world size, `series`): its formula curve and its measured points."""
    fig = go.Figure()
    by_series = series(runs)
    max_world = max((e["spec"].parallel.world_size for es in by_series.values() for e in es), default=1)
    worlds = [w for w in (1, 2, 3, 4, 6, 8, 12, 16) if w <= max(2 * max_world, 4)]
    for st, es in by_series.items():
        color = STRATEGY_COLOR.get(es[0]["spec"].parallel.strategy, "#333")
        xs, ys = analytic_curve(es[0]["spec"], worlds)
        if xs:
            fig.add_scatter(name=f"{st} formula", x=xs, y=[y / MiB for y in ys], mode="lines+markers",
                            line=dict(color=color, dash="dash"), marker=dict(size=5, symbol="circle-open"),
                            hovertemplate=f"{st} formula<br>world %{{x}}: %{{y:.2f}} MiB on the fullest "
                                          "rank<extra></extra>")
        imported = sorted((e for e in es if e["result"].imported is not None
                           and e["result"].imported.peak_allocated_bytes),
                          key=lambda e: e["spec"].parallel.world_size)
        if imported:  # a log's allocator peak, not the categories: its own marker
            fig.add_scatter(name=f"{st} imported (peak allocated)", x=[e["spec"].parallel.world_size for e in imported],
                            y=[e["result"].imported.peak_allocated_bytes / MiB for e in imported], mode="markers",
                            marker=dict(color=color, size=11, symbol="diamond"), customdata=[e["id"] for e in imported],
                            hovertemplate=f"{st} imported run #%{{customdata}}<br>world %{{x}}: %{{y:.2f}} MiB peak "
                                          "allocated (log)<extra></extra>")
        pts = sorted((e for e in es if e["result"].imported is None), key=lambda e: e["spec"].parallel.world_size)
        fig.add_scatter(name=f"{st} measured", x=[e["spec"].parallel.world_size for e in pts],
                        y=[_max_rank(e["result"], "measured") / MiB for e in pts], mode="markers",
                        marker=dict(color=color, size=11), customdata=[e["id"] for e in pts],
                        hovertemplate=f"{st} run #%{{customdata}}<br>world %{{x}}: %{{y:.2f}} MiB "
                                      "measured<extra></extra>")
    fig.update_layout(title="Per-rank memory vs world size (fullest rank)",
                      xaxis_title="world size (ranks)", yaxis_title="params+grads+optimizer+activations (MiB)",
                      **LAYOUT)
    fig.update_xaxes(dtick=1)
    return fig


def throughput_fig(runs: list[dict[str, Any]]) -> go.Figure:
    """A line joins only the runs of one series (`series`); a run alone in its series is a marker."""
    fig = go.Figure()
    for st, es in series(runs).items():
        pts = sorted((e for e in es if e["result"].tokens_per_s), key=lambda e: e["spec"].parallel.world_size)
        if not pts:
            continue
        fig.add_scatter(name=st, x=[e["spec"].parallel.world_size for e in pts],
                        y=[e["result"].tokens_per_s for e in pts], mode="lines+markers" if len(pts) > 1 else "markers",
                        line_color=STRATEGY_COLOR.get(es[0]["spec"].parallel.strategy, "#333"),
                        customdata=[e["id"] for e in pts],
                        hovertemplate=f"{st} run #%{{customdata}}<br>world %{{x}}: %{{y:,.0f}} tokens/s<extra></extra>")
    fig.update_layout(title="Measured throughput vs world size", xaxis_title="world size (ranks)",
                      yaxis_title="throughput (tokens/s)", **LAYOUT)
    fig.update_xaxes(dtick=1)
    return fig


SCALING_FREE = {"parallel": ("world_size", "dp"),
                "train": ("global_batch", "microbatches", "steps", "warmup_steps", "seed")}
"""What may differ between the runs of one scaling series: the world size and what follows from it (dp, the global
batch and its microbatches), and how long or with which seed it ran; also the name and the runtime."""


def series_key(spec: ExperimentSpec) -> str:
    """Runs with equal keys are one scaling series: the same model, strategy, degrees, per-rank batch and precision."""
    data = spec.model_dump(mode="json")
    for section, keys in SCALING_FREE.items():
        for k in keys:
            data[section].pop(k, None)
    data.pop("name", None)
    data.pop("runtime", None)
    return json.dumps(data, sort_keys=True)


def series(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Finished runs with measurements by scaling series, named by strategy ('ddp'), or by strategy and run ids
    ('ddp · #3, #7') where a strategy has more than one series: two unrelated runs never share a line."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in runs:
        res = e.get("result")
        if res is not None and str(res.status) == "ok" and res.per_rank:
            groups.setdefault((str(e["spec"].parallel.strategy), series_key(e["spec"])), []).append(e)
    per_strategy: dict[str, int] = {}
    for st, _ in groups:
        per_strategy[st] = per_strategy.get(st, 0) + 1
    return {(st if per_strategy[st] == 1 else f"{st} · " + ", ".join(f"#{e['id']}" for e in es)): es
            for (st, _), es in groups.items()}
