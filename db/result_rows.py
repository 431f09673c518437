"""Flatten a spec and a RunResult into the column dicts of the store's tables (pure, no I/O)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from backend.result import COLLECTIVES, RunResult, rank_step_s_median
from backend.spec import ExperimentSpec
from backend.spec.dims import DIMS, spec_fields
from db.degrees import spec_values
from db.models import Experiment

CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "peak")
ERROR_CATEGORIES = ("params", "grads", "optimizer", "activations", "peak")


def spec_columns(spec: ExperimentSpec) -> dict[str, Any]:
    """The experiments filter columns of a validated spec (derived degrees already filled in): the parallel
    dimensions in degrees_json, and in the per-degree columns older revisions made (kept, db/models.py)."""
    m, t, p = spec.model, spec.train, spec.parallel
    degrees = spec_values(p)
    return {
        "name": spec.name, "spec_json": spec.model_dump_json(),
        "strategy": str(p.strategy), "world_size": p.world_size, "degrees_json": degrees,
        **{f.key: degrees[f.name] for f in spec_fields(DIMS) if f.key in _EXPERIMENT_COLUMNS},
        "zero_stage": p.zero_stage, "microbatches": t.microbatches,
        "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.kv_heads, "ffn": m.ffn,
        "seq_len": m.seq_len, "vocab": m.vocab_size, "n_experts": m.n_experts, "top_k": m.top_k,
        "global_batch": t.global_batch, "micro_batch": t.micro_batch, "steps": t.steps,
        "precision": str(t.precision), "optimizer": str(t.optimizer), "recompute": str(t.recompute),
        "framework": str(spec.framework),
    }


_EXPERIMENT_COLUMNS = frozenset(Experiment.__table__.c.keys())

PHASE_CHARS = 32  # experiments.progress_phase is VARCHAR(32)


def storable_text(text: str | None) -> str | None:
    """Text both stores accept: PostgreSQL refuses NUL bytes and lone surrogates (a rank's log or traceback can
    hold either), so they are escaped, never dropped silently."""
    if text is None:
        return None
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def progress_columns(step: Any, total: Any, phase: Any) -> dict[str, Any]:
    """Progress as a rank reported it, bounded to what the columns hold (an int or None, <= 32 characters)."""
    def as_int(v: Any) -> int | None:
        return v if type(v) is int and -2**31 <= v < 2**31 else None

    text = None if phase is None else storable_text(str(phase))[:PHASE_CHARS]
    return {"progress_step": as_int(step), "progress_total": as_int(total), "progress_phase": text}


def summary_columns(result: RunResult) -> dict[str, Any]:
    imported = result.imported
    if imported is not None:  # a log gives allocator peaks, not the tracker's categories (issue 25)
        peaks = [imported.peak_allocated_bytes] if imported.peak_allocated_bytes is not None else []
    else:
        peaks = [r.measured.peak_bytes for r in result.per_rank] if str(result.status) == "ok" else []
    return {
        "source_framework": imported.framework if imported is not None else None,
        "peak_allocated_bytes": imported.peak_allocated_bytes if imported is not None else None,
        "peak_reserved_bytes": imported.peak_reserved_bytes if imported is not None else None,
        "status": str(result.status), "error": storable_text(result.error), "failing_rank": result.failing_rank,
        "log_tail": storable_text(result.log_tail), "traceback": storable_text(result.traceback),
        "env_json": json.dumps(result.env, default=str), "step_s_median": result.step_s_median,
        "tokens_per_s": result.tokens_per_s, "loss_max_abs_diff": result.loss_max_abs_diff,
        "bubble_measured": result.bubble_measured, "bubble_predicted": result.bubble_predicted,
        "peak_bytes_max": max(peaks) if peaks else None, "mfu": result.mfu, "wall_s": result.wall_s,
        "result_json": result.model_dump_json(by_alias=True),
    }


def rank_rows(experiment_id: int, result: RunResult) -> list[dict[str, Any]]:
    world = max(result.spec.parallel.world_size or 1, 1)
    measured = result.memory_measured  # else its zero "measured" defaults are stored as NULL
    rows = []
    for r in result.per_rank:
        row: dict[str, Any] = {"experiment_id": experiment_id, "rank": r.rank, "coords_json": json.dumps(r.coords)}
        for cat in CATEGORIES:
            row[f"measured_{cat}_bytes"] = getattr(r.measured, f"{cat}_bytes") if measured else None
            row[f"predicted_{cat}_bytes"] = getattr(r.predicted, f"{cat}_bytes")
        for cat in ERROR_CATEGORIES:
            row[f"error_pct_{cat}"] = r.error_pct.get(f"{cat}_bytes", r.error_pct.get(cat)) if measured else None
        row.update(_step_stats(r.step_s))
        median = row["step_s_median"]
        # This rank's share of the job's throughput if every rank ran at its own median step time.
        row["tokens_per_s_share"] = result.spec.tokens_per_step / median / world if median else None
        row["rss_bytes"] = r.rss_bytes
        row["cuda_max_allocated_bytes"] = r.cuda_max_allocated_bytes
        row["cuda_max_reserved_bytes"] = r.cuda_max_reserved_bytes
        row.update(_rank_comm(r))
        rows.append(row)
    return rows


def _rank_comm(r) -> dict[str, Any]:
    """This rank's comm per step: totals over collectives and payload bytes per collective."""
    stats = r.comm.values()
    out: dict[str, Any] = {
        "comm_bytes": sum(c.bytes for c in stats) if r.comm else None,
        "comm_wire_bytes": sum(c.wire_bytes for c in stats) if r.comm else None,
        # unknown (None) as soon as one collective's seconds could not be measured (nccl functional collectives)
        "comm_seconds": sum(c.seconds for c in stats) if r.comm and all(c.seconds is not None for c in stats) else None,
        "comm_predicted_bytes": sum(r.comm_predicted.values()) if r.comm_predicted else None,
    }
    for coll in COLLECTIVES:
        out[f"comm_{coll}_bytes"] = r.comm[coll].bytes if coll in r.comm else None
    return out


SUMMARY_MAX = [f"{kind}_{c}_bytes" for c in CATEGORIES for kind in ("measured", "predicted")] + [
    "comm_bytes", "comm_wire_bytes", "comm_predicted_bytes", "comm_seconds", *[f"comm_{c}_bytes" for c in COLLECTIVES]]


def summary_row(experiment_id: int, result: RunResult, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """experiment_summaries: maxima over ranks, error % of the maxima, versions."""
    row: dict[str, Any] = {"experiment_id": experiment_id}
    for key in SUMMARY_MAX:
        values = [r[key] for r in ranks if r.get(key) is not None]
        row[key] = max(values) if values else None
    for cat in ERROR_CATEGORIES:
        m, p = row[f"measured_{cat}_bytes"], row[f"predicted_{cat}_bytes"]
        row[f"error_pct_{cat}"] = (m - p) / p * 100.0 if m is not None and p else None
    env = result.env or {}
    row["torch_version"] = _text(env.get("torch") or env.get("torch_version"))
    row["python_version"] = _text(env.get("python") or env.get("python_version"))
    row["step_time_predicted_s"] = result.step_time_predicted_s
    return row


def _text(value: Any) -> str | None:
    return None if value is None else str(value)[:64]


def _step_stats(step_s: list[float]) -> dict[str, Any]:
    if not step_s:
        return {"steps_timed": 0, "step_s_median": None, "step_s_mean": None, "step_s_min": None, "step_s_max": None}
    return {"steps_timed": len(step_s), "step_s_median": rank_step_s_median(step_s),
            "step_s_mean": statistics.fmean(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s)}


def comm_rows(experiment_id: int, result: RunResult) -> list[dict[str, Any]]:
    rows = []
    for r in result.per_rank:
        for coll in sorted(set(r.comm) | set(r.comm_predicted)):
            stat = r.comm.get(coll)
            rows.append({
                "experiment_id": experiment_id, "rank": r.rank, "collective": coll,
                "calls": stat.calls if stat else None, "bytes": stat.bytes if stat else None,
                "wire_bytes": stat.wire_bytes if stat else None, "seconds": stat.seconds if stat else None,
                "predicted_bytes": r.comm_predicted.get(coll),
            })
    return rows


def loss_rows(experiment_id: int, result: RunResult) -> list[dict[str, Any]]:
    n = max(len(result.loss), len(result.loss_reference))
    return [{"experiment_id": experiment_id, "step": i,
             "loss": result.loss[i] if i < len(result.loss) else None,
             "loss_reference": result.loss_reference[i] if i < len(result.loss_reference) else None} for i in range(n)]


def timeline_rows(experiment_id: int, result: RunResult) -> list[dict[str, Any]]:
    return [{"experiment_id": experiment_id, "rank": e.rank, "stage": e.stage, "microbatch": e.microbatch,
             "pass_": e.pass_, "start_s": e.start_s, "end_s": e.end_s} for e in result.timeline]
