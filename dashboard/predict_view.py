"""Figures and tables for the analytic prediction of one spec (New-experiment page)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from backend.analytic.units import GiB, KiB, MiB, to_gb
from backend.number_format import fmt_bytes, fmt_bytes_short, fmt_count_short, fmt_frac
from backend.spec import dims
from dashboard.theme import CATEGORIES, CATEGORY_COLOR, CATEGORY_LABEL, LAYOUT


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def byte_scale(max_bytes: float) -> tuple[float, str]:
    """Divisor and unit so a chart's numbers stay readable (B, KiB, MiB or GiB)."""
    for div, unit in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if max_bytes >= div:
            return div, unit
    return 1.0, "B"


_DEGREES = frozenset(dims.degree_names(dims.DIMS))


def coords_label(coords: dict[str, int] | None) -> str:
    if not coords:
        return ""
    return " ".join(f"{k}{v}" for k, v in coords.items() if k in _DEGREES)


def rank_rows(per_rank: list[Any]) -> list[dict[str, Any]]:
    """Per-rank category bytes from Estimate.per_rank (objects or dicts)."""
    rows = []
    for r in per_rank:
        row = {"rank": int(_get(r, "rank", 0)), "coords": coords_label(_get(r, "coords"))}
        for c in CATEGORIES:
            row[c] = float(_get(r, c, 0) or 0)
        row["total_bytes"] = float(_get(r, "total_bytes", None) or sum(row[c] for c in CATEGORIES))
        fullest = _get(r, "fullest_bytes", None)
        if callable(fullest):  # a RankEstimate: its own fullest moment (never recomputed here)
            row["fullest_bytes"], row["fullest_moment"] = float(fullest()), r.fullest_moment()
        elif fullest is not None:  # its JSON form
            row["fullest_bytes"], row["fullest_moment"] = float(fullest), str(_get(r, "fullest_moment",
                                                                                   "activation_peak"))
        rows.append(row)
    return rows


def per_rank_memory_fig(rows: list[dict[str, Any]], *, device_mem_bytes: float | None = None,
                        title: str = "Predicted memory per rank") -> go.Figure:
    max_total = max((r["total_bytes"] for r in rows), default=0.0)
    div, unit = byte_scale(max(max_total, 1.0))
    x = [f"rank {r['rank']}" + (f" ({r['coords']})" if r["coords"] else "") for r in rows]
    fig = go.Figure()
    for c in CATEGORIES:
        ys = [r[c] / div for r in rows]
        if not any(ys):
            continue
        fig.add_bar(
            name=CATEGORY_LABEL[c], x=x, y=ys, marker_color=CATEGORY_COLOR[c],
            customdata=[fmt_bytes(r[c]) for r in rows],
            hovertemplate=f"%{{x}}<br>{CATEGORY_LABEL[c]}: %{{y:.3f}} {unit} (%{{customdata}})<extra></extra>",
        )
    if device_mem_bytes and device_mem_bytes <= 3 * max(max_total, 1.0):
        fig.add_hline(y=device_mem_bytes / div, line_dash="dash", line_color="black",
                      annotation_text=f"device memory {fmt_bytes(device_mem_bytes)}")
    fig.update_layout(barmode="stack", title=title, xaxis_title="rank (mesh coordinates)",
                      yaxis_title=f"memory per rank ({unit})", **LAYOUT)
    return fig


@dataclass
class Fit:
    fits: bool
    worst_rank: int
    worst_bytes: float
    device_bytes: float
    overhead: dict[str, float] | None = None
    """The runtime allowance included in worst_bytes (analytic/device.allowance_bytes; all zero on cpu ranks)."""
    moment: str = "activation_peak"
    """Which of RankEstimate.moments is the fullest rank's fullest (RankEstimate.fullest_moment)."""
    verdict: str = "fits"
    """analytic/device.fit_verdict: fits, does not fit, or tight (only the allocator slack is over the device)."""

    @property
    def tight(self) -> bool:
        return self.verdict == "tight"

    @property
    def optimizer_step(self) -> bool:
        """The fullest moment is inside optimizer.step (its foreach temporaries), not the activation peak."""
        return self.moment == "optimizer_step"

    @property
    def loss_backward(self) -> bool:
        """The fullest moment is the start of the loss's backward (the log-probs' and logits' fp32 gradients)."""
        return self.moment == "loss_backward"

    def message(self) -> str:
        need = fmt_bytes(self.worst_bytes)
        dev = f"{fmt_bytes(self.device_bytes)} ({to_gb(self.device_bytes):,.4g} GB)"
        why = self._breakdown()
        if self.fits:
            return (f"Fits: the fullest rank (rank {self.worst_rank}) needs {need} of {dev} "
                    f"({self.worst_bytes / self.device_bytes * 100:.3g} %){why}.")
        if self.tight:
            from backend.analytic.device import TIGHT_REASON

            slack = fmt_bytes((self.overhead or {}).get("fragmentation", 0.0))
            return (f"Tight: rank {self.worst_rank} needs {need} > {dev} device memory with {slack} of allocator "
                    f"slack: {TIGHT_REASON}{why}.")
        return (f"Does not fit: rank {self.worst_rank} needs {need} > {dev} device memory "
                f"(short by {fmt_bytes(self.worst_bytes - self.device_bytes)}){why}.")

    def _breakdown(self) -> str:
        parts = [MOMENT_WHY[self.moment]] if self.moment in MOMENT_WHY else []
        o = self.overhead or {}
        if o.get("total"):
            parts.append(f"incl. CUDA context {fmt_bytes(o['cuda_context'])}, NCCL buffers "
                         f"{fmt_bytes(o['nccl_buffers'])}, allocator fragmentation {fmt_bytes(o['fragmentation'])} "
                         "(assumed: backend/analytic/device.py RuntimeOverhead; calibrate with a run's CUDA reserved "
                         "memory)")
        return f"; {'; '.join(parts)}" if parts else ""


MOMENT_WHY = {
    "optimizer_step": "at optimizer.step (foreach temporaries)",
    "loss_backward": "at the start of the loss's backward (fp32 gradients of the log-probs and logits)",
    "backward": "inside backward (the block being back-propagated re-materialised with its gradients; under FSDP the "
                "gathered parameters, unsharded gradients and reduce-scatter buffer)",
}
"""What holds the memory at each non-default fullest moment (RankEstimate.moments), for the fit message."""


def _fullest(r: dict[str, Any]) -> tuple[float, str]:
    """(bytes the rank holds at its fullest moment, which moment): the estimate's own `fullest_bytes` /
    `fullest_moment` of the rank (rank_rows), never recomputed here."""
    fullest = r.get("fullest_bytes")
    if fullest is None:
        return float(r["total_bytes"]), "activation_peak"
    return float(fullest), str(r.get("fullest_moment"))


def fit_check(rows: list[dict[str, Any]], device_mem_bytes: float) -> Fit:
    """Does the fullest rank fit device_mem_bytes: analytic/device.fits_device, the one rule `estimate --hardware` and
    Plan apply, on the rank's fullest moment, with the ranks' layout and device as `predict` put them on the rows (a
    row without them: cpu ranks, no allowance). Its need and breakdown are that rule's need_bytes / allowance_bytes."""
    from backend.analytic.device import CPU, FITS, allowance_bytes, fit_verdict

    if not rows:
        return Fit(True, 0, 0.0, device_mem_bytes)
    worst = max(rows, key=lambda r: _fullest(r)[0])  # the allowance grows with the fullest moment: the same rank
    fullest, moment = _fullest(worst)
    parallel, device = worst.get("parallel"), str(worst.get("device", CPU))
    allowance = allowance_bytes(fullest, parallel, device)
    verdict = fit_verdict(fullest, parallel, device, device_mem_bytes)
    return Fit(verdict == FITS, worst["rank"], fullest + allowance["total"], device_mem_bytes, allowance,
               moment=moment, verdict=verdict)


def comm_frame(per_rank: list[Any]) -> pd.DataFrame:
    """Predicted payload and ring wire bytes per step per collective: rank 0 and the busiest rank."""
    recs: dict[str, dict[str, float]] = {}
    for r in per_rank:
        payload, wire = _get(r, "comm_bytes", {}) or {}, _get(r, "comm_wire_bytes", {}) or {}
        for coll in set(payload) | set(wire):
            d = recs.setdefault(coll, {"rank0_payload": 0.0, "max_payload": 0.0, "max_wire": 0.0})
            p, w = float(payload.get(coll, 0) or 0), float(wire.get(coll, 0) or 0)
            if int(_get(r, "rank", 0)) == 0:
                d["rank0_payload"] = p
            d["max_payload"], d["max_wire"] = max(d["max_payload"], p), max(d["max_wire"], w)
    rows = [
        {"collective": k, "payload, rank 0": fmt_bytes(v["rank0_payload"]),
         "payload, busiest rank": fmt_bytes(v["max_payload"]), WIRE_COLUMN: fmt_bytes(v["max_wire"])}
        for k, v in sorted(recs.items()) if v["max_payload"] or v["max_wire"]
    ]
    return pd.DataFrame(rows, columns=["collective", "payload, rank 0", "payload, busiest rank", WIRE_COLUMN])


WIRE_COLUMN = "on the wire, busiest rank"
"""What a ring algorithm sends per rank for the payload (glossary.HELP["wire"])."""


def headline(est: Any) -> dict[str, str]:
    """The few numbers shown as metrics above the chart."""
    comm = _get(est, "comm_bytes_per_step")
    comm_total = sum(comm.values()) if isinstance(comm, dict) else comm
    bubble = _get(est, "bubble_fraction")
    return {  # three significant digits: a metric cuts longer values off ("527.00 …")
        "parameters": fmt_count_short(float(_get(est, "params_total", 0) or 0)),
        "comm / step": fmt_bytes_short(comm_total),
        "pipeline bubble": fmt_frac(bubble) if bubble is not None else "–",
        "FLOPs / step": f"{float(_get(est, 'flops_per_step', 0) or 0):.3g}".replace("e+0", "e").replace("e+", "e"),
        "tokens / step": fmt_count_short(int(_get(est, "tokens_per_step", 0) or 0)),
    }


HEADLINE_HELP = {
    "parameters": "All parameters of the model (every rank together holds at least one copy).",
    "comm / step": "Payload of every collective of the busiest rank per optimizer step (the table below breaks it "
                   "down).",
    "pipeline bubble": "Share of the step a pipeline stage idles: (p - 1) / (m + p - 1) for GPipe and 1F1B.",
    "FLOPs / step": "Model FLOPs of one optimizer step over all ranks (6 x parameters x tokens + attention).",
    "tokens / step": "Global batch x sequence length.",
}

PREDICT_PAGE = 512
"""Ranks the live prediction charts one by one; beyond them, one rank of every class of identical ranks."""


def shown_ranks(est: Any, page: int = PREDICT_PAGE) -> list[Any]:
    """The first `page` ranks, then the lowest rank of every other distinct prediction (so the fullest rank is
    always among them): all ranks of a world up to `page`, a few dozen of a million."""
    shown = est.page(0, page)
    seen = {r.rank for r in shown}
    return shown + [r for r, _ in est.distinct_ranks if r.rank not in seen]


def predict(spec: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Run the analytic estimate for a validated spec on the device its ranks would get on this host (`auto`
    resolved as the engine does): (Estimate, rows for the chart and the fit check, with the fit check's extra
    terms; `shown_ranks`: every rank of a small world, a page plus every distinct prediction of a large one)."""
    from backend.analytic.device import runtime_overhead_bytes, with_device
    from backend.analytic.estimate import estimate
    from backend.engine.device_facts import host_device

    spec = with_device(spec, host_device(str(spec.runtime.device)))
    est = estimate(spec)
    shown = shown_ranks(est)
    rows = rank_rows(shown)
    # what fit_check hands the one fit rule, and the allowance the chart shows
    for row, r in zip(rows, shown, strict=False):
        row["overhead"] = runtime_overhead_bytes(spec, r.fullest_bytes())
        row["parallel"], row["device"] = spec.parallel, str(spec.runtime.device)
    return est, rows


def flash_saving(cmp: dict[str, int], recompute: str) -> tuple[str, str, str]:
    """(label, value, help) of the third attention metric (spec_form.attention_comparison): what flash saves, or what
    it keeps beyond math, never a negative saving. Under op-level recompute flash keeps more: the op list saves
    the flash kernel's output and logsumexp (so it is not re-run) but not math attention's bmm outputs, which backward
    re-runs (memory/activations.op_sac_saved_bytes)."""
    diff = cmp["math"] - cmp["flash"]
    if diff > 0:
        return ("flash saves", fmt_bytes_short(diff),
                "math saves the (b, a, s, s) probabilities; flash keeps q, k, v, out and a logsumexp")
    if diff == 0:
        return ("flash saves", fmt_bytes_short(0), f"nothing under {recompute} recompute: the attention core is "
                "re-run in backward with either kernel, so neither keeps its tensors")
    why = ("op-level recompute keeps the outputs of the ops on its list: the flash kernel is on it (its output and "
           "logsumexp are kept so it is not re-run), math attention's matmuls are not (they are re-run in backward)"
           if recompute == "op" else "flash keeps q, k, v, out and a logsumexp where math keeps less here")
    return "flash keeps more", fmt_bytes_short(-diff), why
