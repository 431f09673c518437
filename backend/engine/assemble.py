"""Turn the gathered per-rank payloads (DIR/ranks.json) into a RunResult, next to the analytic predictions.

A pure function of (spec, payload), payload = `RanksFile.to_dict()`: the typed file of
backend/runtime/protocol.py (`RanksFile`, one `RankPayload` per rank), as JSON. Inside a rank payload:
  "comm": {collective: {"calls", "bytes", "wire_bytes", "seconds"}}   # per timed step
  "comm_excluded": {collective: bytes per step}   # bookkeeping (loss report), not training comm
  "memory": {"categories": {params_bytes, grads_bytes, optimizer_bytes, activations_bytes, other_bytes},
             "moment": "activation_peak", "peak_bytes", "at_peak": {same keys}, "high_water": {same keys},
             "tracker_at_activation_peak" / "tracker_at_peak" / "tracker_high_water": {tracker category: bytes},
             "cuda_max_allocated_bytes", "cuda_max_reserved_bytes", "rss_bytes"}   # see bench/memory.py
  "timeline": [{rank, stage, microbatch, pass, start_s, end_s}, ...]
  "extra": {"moe_routing": {...}}   # optional, strategy-measured (ep: backend/strategies/ep.routing_payload;
                                    # fp16: "loss_scaling": {skipped_steps, steps, scale}, strategies/scaler.py)
"""

from __future__ import annotations

from statistics import median
from typing import Any

from backend.analytic.estimate import RankEstimate, estimate
from backend.analytic.measured.bubble_measure import measured_bubble_fraction
from backend.analytic.model_flops import training_flops_per_step
from backend.bench.env import merge as merge_env
from backend.engine.accuracy_notes import (  # noqa: F401 - re-exported
    BOUNDS_PCT,
    COMM_BOUND_PCT,
    PARITY_BOUND,
    WHY,
    autocast_notes,
    comm_error_pct,
    comm_notes,
    cp_notes,
    dedupe,
    divergence_notes,
    loss_parity,
    memory_notes,
    parity_notes,
    recompute_notes,
    routing_notes,
)
from backend.engine.device_facts import utilization
from backend.result import MEMORY_CATEGORIES, CommStat, MemoryBreakdown, RankResult, RunResult, Status, error_pct
from backend.spec import ExperimentSpec
from backend.strategies.compiled import eager_twin


def run_device(payload: dict[str, Any]) -> str | None:
    """The device type the ranks ran on (their env), or None when the payload does not say."""
    types = {r.get("env", {}).get("device_type") for r in payload.get("ranks", [])} - {None}
    return types.pop() if len(types) == 1 else None


def model_flops_per_step(spec: ExperimentSpec) -> float:
    """Model FLOPs per step (MFU's numerator): the training FLOPs without any recompute (PaLM App. B)."""
    m = spec.model
    return training_flops_per_step(m, tokens=spec.tokens_per_step, recompute="none")


def assemble_result(spec: ExperimentSpec, payload: dict[str, Any]) -> RunResult:
    est = estimate(spec, device=run_device(payload))
    measured_as = eager_twin(spec)  # the memory-tracked step's own blocks (strategies/compiled.py)
    mem_est = est if measured_as is spec else estimate(measured_as, device=run_device(payload))
    ranks = sorted(payload["ranks"], key=lambda r: r["rank"])
    notes = dedupe(n for r in ranks for n in r.get("notes", []))
    notes += [n for n in est.notes if n not in notes]
    per_rank = [_rank_result(r, mem_est.per_rank[r["rank"]]) for r in ranks]
    notes += memory_notes(per_rank)
    notes += autocast_notes(spec, per_rank)
    notes += recompute_notes(spec, per_rank)
    notes += routing_notes(spec, ranks, per_rank)
    notes += cp_notes(spec, ranks)
    notes += comm_notes(ranks, per_rank, payload.get("backend", ""))
    step_med = step_s_median([r["step_s"] for r in ranks])
    loss = [float(x) for x in ranks[0]["losses"]] if ranks else []
    ref = [float(x) for x in payload.get("loss_reference", [])]
    env = merge_env([r.get("env", {}) for r in ranks])
    achieved = est.flops_per_step / step_med if step_med else None
    timeline = [ev for r in ranks for ev in r.get("timeline", [])]
    diff = loss_parity(loss, ref)
    notes += divergence_notes(loss, ref) + parity_notes(spec, diff)
    skipped, scaling_notes = _loss_scaling(ranks)
    notes += scaling_notes
    dropped, capacity_notes = tokens_dropped(ranks)
    notes += capacity_notes
    model_flops = model_flops_per_step(spec)
    mfu, hfu = utilization(model_flops, est.flops_per_step, step_med, env, str(spec.train.precision),
                           spec.parallel.world_size)
    return RunResult(
        status=Status.OK, spec=spec, env=env, per_rank=per_rank, step_s_median=step_med,
        tokens_per_s=spec.tokens_per_step / step_med if step_med else None,
        flops_per_step=est.flops_per_step, achieved_flops=achieved, mfu=mfu, hfu=hfu,
        model_flops_per_step=model_flops,
        loss=loss, loss_reference=ref,
        loss_max_abs_diff=diff, loss_scaling_skipped_steps=skipped, tokens_dropped=dropped,
        timeline=timeline, bubble_measured=_bubble(timeline), bubble_predicted=est.bubble_fraction, notes=notes,
    )


def _loss_scaling(ranks: list[dict[str, Any]]) -> tuple[list[int] | None, list[str]]:
    """fp16-mixed: the steps the loss scaler skipped (agreed by every rank: backend/strategies/scaler.py) and a note."""
    reports = [r.get("extra", {}).get("loss_scaling") for r in ranks]
    if not any(reports):
        return None, []
    seen = {tuple(rep.get("skipped_steps", [])) if rep else None for rep in reports}
    rep = next(r for r in reports if r)
    skipped = list(rep.get("skipped_steps", []))
    notes = [f"fp16 loss scaling (ShardedGradScaler, found-inf all-reduced over the world): {len(skipped)} of "
             f"{rep.get('steps')} optimizer steps skipped for inf/NaN gradients"
             + (f" (engine steps {skipped}, 0 = first warm-up step)" if skipped else "")
             + f"; final scale {rep.get('scale', 0):g}. Reported losses are unscaled."]
    if len(seen) > 1:
        notes.append(f"LOSS SCALING DISAGREES across ranks (skipped steps per rank: {sorted(map(str, seen))}): the "
                     "ranks did not take the same optimizer steps.")
    return skipped, notes


def tokens_dropped(ranks: list[dict[str, Any]]) -> tuple[int | None, list[str]]:
    """The capacity limit's dropped slots of the memory-tracked step (strategies/moe_stats.py), summed over the ranks of
    tp index 0 (tp ranks route the same tokens), and a note with the share of routed slots."""
    records = [r["extra"]["moe_capacity"] for r in ranks
               if r.get("extra", {}).get("moe_capacity") and r.get("coords", {}).get("tp", 0) == 0]
    if not records:
        return None, []
    dropped, routed = sum(int(x["dropped"]) for x in records), sum(int(x["routed"]) for x in records)
    first = records[0]
    share = f" ({100 * dropped / routed:.2f}%)" if routed else ""
    return dropped, [f"Capacity factor {first['capacity_factor']:g}" + (" padded to capacity" if first["pad"] else "")
                     + f": {dropped:,} of {routed:,} routed token-slots dropped in one step{share}, per rank on "
                     f"{first['tokens']:,} tokens per MoE call (Megatron's per-rank limit, lowest router probability "
                     "first)."]


def predicted_memory(pred: RankEstimate) -> MemoryBreakdown:
    """A rank's predicted memory as every stored result holds it, measured or not (a failed run's too:
    launcher.predicted_ranks): its peak is the fullest moment, not the activation peak (total_bytes)."""
    return MemoryBreakdown(params_bytes=pred.params_bytes, grads_bytes=pred.grads_bytes,
                           optimizer_bytes=pred.optimizer_bytes, activations_bytes=pred.activations_bytes,
                           other_bytes=pred.other_bytes, peak_bytes=pred.fullest_bytes())


def _rank_result(r: dict[str, Any], pred: Any) -> RankResult:
    mem = r.get("memory", {})
    measured = MemoryBreakdown(**mem.get("categories", {}), peak_bytes=mem.get("peak_bytes", 0),
                               moment=mem.get("moment"), at_peak=mem.get("at_peak", {}),
                               high_water=mem.get("high_water", {}))
    predicted = predicted_memory(pred)
    errs = {k: error_pct(getattr(measured, k), getattr(predicted, k)) for k in MEMORY_CATEGORIES}
    errs["peak_bytes"] = error_pct(measured.peak_bytes, predicted.peak_bytes)
    return RankResult(
        rank=r["rank"], measured=measured, predicted=predicted, error_pct=errs, step_s=list(r.get("step_s", [])),
        comm={k: CommStat(**v) for k, v in r.get("comm", {}).items()},
        comm_predicted=dict(pred.comm_bytes), comm_excluded=r.get("comm_excluded", {}),
        comm_wire_predicted=dict(getattr(pred, "comm_wire_bytes", {})),
        rss_bytes=mem.get("rss_bytes"), cuda_max_allocated_bytes=mem.get("cuda_max_allocated_bytes"),
        cuda_max_reserved_bytes=mem.get("cuda_max_reserved_bytes"), coords=dict(r.get("coords", {})),
    )


def _bubble(timeline: list[dict[str, Any]]) -> float | None:
    if not timeline:
        return None
    steps: dict[Any, list[dict[str, Any]]] = {}
    for ev in timeline:
        steps.setdefault(ev.get("step"), []).append(ev)
    values = [v for v in (measured_bubble_fraction(evs) for evs in steps.values()) if v is not None]
    return median(values) if values else None


def step_s_median(per_rank_step_s: list[list[float]]) -> float | None:
    """Median over steps of the slowest rank's time for that step (a step ends when its last rank does)."""
    if not per_rank_step_s or not all(per_rank_step_s):
        return None
    n = min(len(s) for s in per_rank_step_s)
    return median(max(s[i] for s in per_rank_step_s) for i in range(n))
