"""Pipeline timelines: the measured per-rank Gantt and the ideal schedule it should approach.

The ideal schedule replays each rank's measured op order (or a generated GPipe/1F1B order) with unit
costs F=1, B=2 (B=1, W=1 when W is split out) and only the data dependencies between stages, so
its bubble is the schedule's own, free of measurement noise.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from dashboard.theme import LAYOUT, PASS_COLOR

COMPUTE = ("F", "B", "W")


def _ev(e: Any) -> dict[str, Any]:
    if isinstance(e, dict):
        return {"rank": e["rank"], "stage": e["stage"], "microbatch": e["microbatch"],
                "pass": e.get("pass", e.get("pass_")), "start_s": e["start_s"], "end_s": e["end_s"]}
    return {"rank": e.rank, "stage": e.stage, "microbatch": e.microbatch, "pass": e.pass_, "start_s": e.start_s,
            "end_s": e.end_s}


def normalize(events: list[Any]) -> list[dict[str, Any]]:
    evs = [_ev(e) for e in events]
    t0 = min((e["start_s"] for e in evs), default=0.0)
    for e in evs:
        e["start_s"] -= t0
        e["end_s"] -= t0
    return evs


def bubble_of(events: list[dict[str, Any]]) -> float | None:
    """1 - busy compute time / (ranks * makespan)."""
    comp = [e for e in events if e["pass"] in COMPUTE]
    if not comp:
        return None
    ranks = {e["rank"] for e in comp}
    span = max(e["end_s"] for e in comp) - min(e["start_s"] for e in comp)
    busy = sum(e["end_s"] - e["start_s"] for e in comp)
    return max(0.0, 1.0 - busy / (len(ranks) * span)) if span > 0 else None


def gantt_fig(events: list[dict[str, Any]], *, title: str, time_unit: str = "ms") -> go.Figure:
    scale = {"ms": 1e3, "units": 1.0}[time_unit]
    fig = go.Figure()
    for p in ("F", "B", "W", "send", "recv"):
        evs = [e for e in events if e["pass"] == p]
        if not evs:
            continue
        fig.add_bar(
            name={"F": "forward",
                  "B": "backward (input grad)" if any(x["pass"] == "W" for x in events) else "backward",
                  "W": "backward (weight grad)"}.get(p, p),
            orientation="h", base=[e["start_s"] * scale for e in evs],
            x=[(e["end_s"] - e["start_s"]) * scale for e in evs],
            y=[f"rank {e['rank']}" for e in evs], marker_color=PASS_COLOR.get(p, "#999"), marker_line_width=0.5,
            text=[f"{p}{e['microbatch']}" for e in evs], textposition="inside", insidetextanchor="middle",
            customdata=[[e["stage"], e["microbatch"], e["start_s"] * scale, e["end_s"] * scale] for e in evs],
            hovertemplate=f"%{{y}} stage %{{customdata[0]}} microbatch %{{customdata[1]}}<br>{p}: "
                          f"%{{customdata[2]:.2f}}–%{{customdata[3]:.2f}} {time_unit} (%{{x:.2f}} "
                          f"{time_unit})<extra></extra>",
        )
    ranks = sorted({e["rank"] for e in events})
    fig.update_layout(barmode="overlay", title=title, xaxis_title=f"time ({time_unit})", yaxis_title="pipeline rank",
                      **LAYOUT)
    fig.update_yaxes(categoryorder="array", categoryarray=[f"rank {r}" for r in reversed(ranks)])
    return fig


def generated_order(schedule: str, *, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per-rank op order (pass, stage, microbatch) for GPipe and 1F1B with one stage per rank."""
    order: dict[int, list[tuple[str, int, int]]] = {}
    for r in range(p):
        if schedule == "gpipe":
            order[r] = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            continue
        warm = min(p - r - 1, m)
        ops = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", r, f))
                f += 1
            ops.append(("B", r, b))
            b += 1
        order[r] = ops
    return order


def measured_order(events: list[dict[str, Any]]) -> dict[int, list[tuple[str, int, int]]]:
    order: dict[int, list[tuple[str, int, int]]] = {}
    for e in sorted((e for e in events if e["pass"] in COMPUTE), key=lambda e: (e["rank"], e["start_s"])):
        order.setdefault(e["rank"], []).append((e["pass"], e["stage"], e["microbatch"]))
    return order


def simulate(order: dict[int, list[tuple[str, int, int]]]) -> list[dict[str, Any]]:
    """Earliest start times for each rank's ops in order, honouring stage-to-stage dependencies."""
    has_w = any(op[0] == "W" for ops in order.values() for op in ops)
    cost = {"F": 1.0, "B": 1.0 if has_w else 2.0, "W": 1.0}
    last_stage = max((op[1] for ops in order.values() for op in ops), default=0)
    done: dict[tuple[str, int, int], float] = {}
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    out: list[dict[str, Any]] = []
    progressed = True
    while progressed:
        progressed = False
        for r, ops in order.items():
            while pos[r] < len(ops):
                p, s, mb = ops[pos[r]]
                deps = _deps(p, s, mb, last_stage)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                done[(p, s, mb)] = free[r] = start + cost[p]
                out.append({"rank": r, "stage": s, "microbatch": mb, "pass": p, "start_s": start,
                            "end_s": start + cost[p]})
                pos[r] += 1
                progressed = True
    return out


def _deps(p: str, s: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    if p == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if p == "B":
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
    return [("B", s, mb)]


def ideal_events(events: list[dict[str, Any]] | None, *, schedule: str, p: int, m: int) -> list[dict[str, Any]]:
    order = measured_order(events) if events else generated_order(schedule, p=p, m=m)
    return simulate(order)
