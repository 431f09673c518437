"""The run's notes: every place a measurement misses its prediction (or its bound) gets a sentence saying
where and why, never hidden; the bounds they check; loss parity. Used by backend/engine/assemble.py."""

from __future__ import annotations

import math
from statistics import median
from typing import Any

from backend.analytic.measured.moe_routing import adjustment
from backend.analytic.params import param_list
from backend.result import (  # noqa: F401 - re-exported
    COLLECTIVES,
    MEMORY_CATEGORIES,
    PARITY_BOUND,
    PARITY_FAILS,
    RankResult,
    RoutingAdjusted,
    error_pct,
    first_non_finite,
    parity_failure_text,
    parity_verdict,
)
from backend.spec import ExperimentSpec

BOUNDS_PCT = {"params_bytes": 2.0, "grads_bytes": 2.0, "optimizer_bytes": 2.0, "activations_bytes": 15.0}
COMM_BOUND_PCT = 5.0

WHY = {
    "params_bytes": "parameter storage at the peak; under FSDP2 it includes whichever unsharded units are "
                    "resident at that moment (prefetch / reshard timing decides how many)",
    "grads_bytes": "gradient storage at the peak; if the peak falls before the last backward finished, only the "
                   "gradients produced so far are resident",
    "optimizer_bytes": "optimizer state at the peak; ZeRO-1 partitions whole parameters, and a peak inside "
                       "optimizer.step adds its foreach temporaries",
    "activations_bytes": "the tracker counts every tensor created in forward that is still alive at the peak "
                         "(incl. temporaries held by the caller), the formula only what autograd saves for backward",
}


def loss_parity(loss: list[float], ref: list[float]) -> float | None:
    """max |loss - reference| over the steps both have. Two non-finite losses alike (both NaN, or the same inf) agree:
    the run and the reference diverged together; one finite and one not is inf. None without a common step."""
    diffs = []
    for a, b in zip(loss, ref, strict=False):
        if math.isfinite(a) and math.isfinite(b):
            diffs.append(abs(a - b))
        elif not (math.isnan(a) and math.isnan(b)) and a != b:
            diffs.append(math.inf)
    return max(diffs, default=0.0) if loss and ref else None


def divergence_notes(loss: list[float], ref: list[float]) -> list[str]:
    """A run whose loss became NaN or inf diverged: say from which step (1-based, warm-up first) and what the
    reference did. The run stays ok: it ran and measured; its losses are kept as they are."""
    at = first_non_finite(loss)
    if at is None:
        return []
    bad = sum(not math.isfinite(v) for v in loss)
    ref_at = first_non_finite(ref) if ref else None
    same = ("the single-process reference diverged at the same step" if ref_at == at else
            f"the single-process reference diverged at step {ref_at + 1}" if ref_at is not None else
            "the single-process reference stayed finite" if ref else "no single-process reference ran")
    return [f"DIVERGED: the loss is {loss[at]} from step {at + 1} of {len(loss)} on ({bad} of {len(loss)} steps not "
            f"finite); {same}. Memory and step time were measured as usual; loss parity compares the steps where "
            "both losses are finite."]


def parity_notes(spec: ExperimentSpec, diff: float | None) -> list[str]:
    precision = str(spec.train.precision)
    return [parity_failure_text(precision, diff)] if parity_verdict(precision, diff) == PARITY_FAILS else []


def comm_error_pct(rr: RankResult) -> dict[str, float | None]:
    """Payload error per collective, over every collective measured or predicted on this rank."""
    keys = [k for k in COLLECTIVES if k in rr.comm or k in rr.comm_predicted]
    return {k: error_pct(rr.comm[k].bytes if k in rr.comm else 0.0, rr.comm_predicted.get(k, 0.0)) for k in keys}


def memory_notes(per_rank: list[RankResult]) -> list[str]:
    notes = []
    for cat, bound in BOUNDS_PCT.items():
        off = [(rr.rank, rr.error_pct.get(cat), getattr(rr.measured, cat), getattr(rr.predicted, cat))
               for rr in per_rank if rr.error_pct.get(cat) is not None and abs(rr.error_pct[cat]) > bound]
        if off:
            detail = ", ".join(f"rank {r}: {m:,} vs {p:,} B ({e:+.1f}%)" for r, e, m, p in off[:4])
            notes.append(f"{cat} misses the ±{bound:g}% bound ({detail}): {WHY[cat]}.")
    for rr in per_rank[:1]:
        at_act = sum(getattr(rr.measured, k) for k in (*MEMORY_CATEGORIES, "other_bytes"))
        if rr.measured.peak_bytes > 1.15 * at_act:
            notes.append(f"rank {rr.rank}: the step's total tracked peak ({rr.measured.peak_bytes:,} B) is "
                         f"{rr.measured.peak_bytes / at_act - 1:.0%} above the categories' sum at the activation peak "
                         f"({at_act:,} B), where categories are measured; at the total peak: "
                         + ", ".join(f"{k} {v:,}" for k, v in (getattr(rr.measured, "at_peak", None) or {}).items())
                         + ".")
    return notes


def autocast_notes(spec: ExperimentSpec, per_rank: list[RankResult]) -> list[str]:
    """DDP / ZeRO-1 run mixed precision under torch.autocast, whose activation memory the 16-bit formula misses."""
    if str(spec.train.precision) == "fp32" or spec.parallel.strategy_module not in ("ddp", "zero1"):
        return []
    off = [rr for rr in per_rank if (rr.error_pct.get("activations_bytes") or 0) > BOUNDS_PCT["activations_bytes"]]
    if not off:
        return []
    cache = 2 * sum(q.numel for q in param_list(spec.model) if q.name.startswith(("layers.", "lm_head"))
                    and ".ln" not in q.name)
    return [f"mixed precision here is torch.autocast: it caches a 16-bit copy of every Linear weight and bias for the "
            f"whole forward (≈{cache:,} B, tracked as activations) and keeps LayerNorm/softmax outputs and the "
            f"residual stream in fp32, while the formula counts every saved activation at 2 B."]


def recompute_notes(spec: ExperimentSpec, per_rank: list[RankResult]) -> list[str]:
    if str(spec.train.recompute) != "full":
        return []
    if not any(abs(rr.error_pct.get("activations_bytes") or 0) > BOUNDS_PCT["activations_bytes"] for rr in per_rank):
        return []
    return ["under full recompute the activations peak while the last block is recomputed in backward, after the "
            "head's saved tensors (logits, log-softmax) are freed: L checkpointed block inputs + one block's full "
            "activations + its recomputed output, not that plus the head term."]


def routing_notes(spec: ExperimentSpec, ranks: list[dict[str, Any]], per_rank: list[RankResult]) -> list[str]:
    """EP: set each rank's routing-adjusted prediction and explain, per rank where the uniform-routing prediction
    misses a bound, how far the measured routing was from uniform and how the adjusted prediction fares."""
    notes = []
    for r, rr in zip(ranks, per_rank, strict=False):
        routing = r.get("extra", {}).get("moe_routing")
        if not routing or not routing.get("records"):
            continue
        adj = adjustment(spec, routing)
        a2a_pred = rr.comm_predicted.get("all_to_all", 0.0)
        rr.predicted_given_routing = RoutingAdjusted(
            activations_bytes=int(round(rr.predicted.activations_bytes + adj.activations_delta_bytes)),
            all_to_all_bytes=adj.all_to_all_bytes, received_token_slots=adj.received_slots,
            uniform_token_slots=adj.uniform_slots)
        a2a = rr.comm["all_to_all"].bytes if "all_to_all" in rr.comm else 0.0
        act = rr.measured.activations_bytes
        e_a2a, e_act = error_pct(a2a, a2a_pred), rr.error_pct.get("activations_bytes")
        if not ((e_a2a is not None and abs(e_a2a) > COMM_BOUND_PCT)
                or (e_act is not None and abs(e_act) > BOUNDS_PCT["activations_bytes"])):
            continue
        g = rr.predicted_given_routing
        notes.append(
            f"rank {rr.rank}: the prediction assumes uniform expert routing; this rank's experts received "
            f"{adj.received_slots:,} token-slots on the measured step vs {adj.uniform_slots:,.0f} uniform "
            f"(= {adj.load:.2f}× uniform). all_to_all {a2a:,.0f} B vs uniform {a2a_pred:,.0f} B ({_pct(e_a2a)}) vs "
            f"routing-adjusted {g.all_to_all_bytes:,.0f} B ({_pct(error_pct(a2a, g.all_to_all_bytes))}); "
            f"activations {act:,} B vs uniform {rr.predicted.activations_bytes:,} B ({_pct(e_act)}) vs "
            f"routing-adjusted {g.activations_bytes:,} B ({_pct(error_pct(act, g.activations_bytes))}: the all-to-all "
            f"dispatch's saved tensors at the counts of the heaviest microbatch, {adj.peak_microbatch}); a prediction "
            f"at this load: model.moe_imbalance={max(adj.load, 1.0):.2f} (analytic/moe_rows.py).")
    return notes


def _pct(e: float | None) -> str:
    return "n/a" if e is None else f"{e:+.1f}%"


def comm_notes(ranks: list[dict[str, Any]], per_rank: list[RankResult], backend: str) -> list[str]:
    notes = []
    for rr in per_rank:
        errs = comm_error_pct(rr)
        for k, e in errs.items():
            measured = rr.comm[k].bytes if k in rr.comm else 0.0
            if e is None and measured:
                notes.append(f"rank {rr.rank}: {k} {measured:,.0f} B/step measured but not predicted.")
            elif e is not None and abs(e) > COMM_BOUND_PCT:
                notes.append(f"rank {rr.rank}: {k} payload {measured:,.0f} vs predicted "
                             f"{rr.comm_predicted.get(k, 0):,.0f} B/step ({e:+.1f}%).")
    if backend == "gloo" and any("reduce_scatter" in r.get("comm", {}) for r in ranks):
        notes.append("gloo implements reduce_scatter as an all-reduce: bytes actually sent are ≈2× the ring "
                     "reduce-scatter wire_bytes reported (payload and wire_bytes are the algorithmic values).")
    notes += _kernel_vs_tracked_notes(ranks)
    excl = {k: v for r in ranks[:1] for k, v in r.get("comm_excluded", {}).items()}
    if excl:
        notes.append("not counted as training comm: the loss report's scalar all-reduce "
                     f"({', '.join(f'{k} {v:,.0f} B/step' for k, v in excl.items())}).")
    return dedupe(notes)


def _kernel_vs_tracked_notes(ranks: list[dict[str, Any]]) -> list[str]:
    """Cross-check: kernel-hook counts on the comm-timing steps vs the complete count on the tracked step."""
    gaps: dict[tuple[str, float, float], list[int]] = {}
    for r in ranks:
        kernel, full = r.get("comm_kernel", {}), r.get("comm", {})
        for k in sorted(set(kernel) | set(full)):
            a, b = kernel.get(k, {}).get("bytes", 0.0), full.get(k, {}).get("bytes", 0.0)
            if abs(a - b) > 0.05 * max(a, b):
                gaps.setdefault((k, a, b), []).append(r["rank"])
    notes = []
    for (k, a, b), who in gaps.items():
        why = (" (DDP rebuilds its buckets once, broadcasting the new order, in its 2nd iteration)"
               if k == "broadcast" and a < 4096 and not b else "")
        notes.append(f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}: {k} {a:,.0f} B/step counted on "
                     f"the comm-timing steps (kernel hooks) vs {b:,.0f} B on the memory-tracked step{why}; comm bytes "
                     "are from the tracked step.")
    return notes


def dedupe(items: Any) -> list[str]:
    out: list[str] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def cp_notes(spec: ExperimentSpec, ranks: list[dict[str, Any]]) -> list[str]:
    """Context parallelism on CPU ranks: the seconds the busiest rank waited on the ring's K/V and dK/dV transfers per
    timed step (strategies/cp.ContextShard.measured: the ring communication its attention blocks did not hide), next to
    the step-time model's exposed ring time on the `cpu` profile when there is one."""
    if spec.parallel.cp == 1:
        return []
    t = spec.train
    waits = []
    for r in ranks:
        record = (r.get("extra") or {}).get("cp_ring") or {}
        timed = record.get("wait_s", [])[t.warmup_steps:t.warmup_steps + t.steps]
        if timed:
            waits.append((median(timed), median(r.get("step_s") or [0.0]), r["rank"]))
    if not waits:
        return []
    wait, step, rank = max(waits)
    share = f", {wait / step:.0%} of its step" if step else ""
    predicted = _predicted_cp_exposed_s(spec)
    pred = (f"; the step-time model predicts {predicted * 1e3:.1f} ms exposed on the cpu profile"
            if predicted is not None
            else "; no cpu profile to predict it from")
    return [f"CP ring: rank {rank} waited {wait * 1e3:.1f} ms per step on K/V and dK/dV transfers (median of the timed "
            f"steps, the most of any rank{share}): the ring communication its attention blocks did not hide{pred}."]


def _predicted_cp_exposed_s(spec: ExperimentSpec) -> float | None:
    try:
        from backend.analytic.steptime.hardware import CPU, load_profiles
        from backend.analytic.steptime.model import step_time

        profiles = load_profiles()
        if CPU not in profiles:
            return None
        return max(r.exposed_by_dim_s.get("cp", 0.0) for r in step_time(spec, profiles[CPU]).per_rank)
    except Exception:  # noqa: BLE001 - a gap in the step-time model leaves the comparison out, never the run
        return None
