"""A trace in the experiment history: an `experiments` row of kind "traced", shown like a run (run page,
Compare, export) with the traced bytes as `measured` next to the prediction.

`begin_trace` makes the row at once (status running, so the runs page shows it while ranks are traced; the
worker only claims queued rows), `finish_trace` stores the outcome through the same `store_result` as a run.
An `unsupported` trace is stored as failed with the torch limitation in its error; the trace's own status
stays in result_json under "trace".
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Engine

from backend.result import MemoryBreakdown, RankResult, RunResult, Status
from backend.spec import ExperimentSpec

KIND = "traced"


def begin_trace(engine: Engine, spec: ExperimentSpec) -> int:
    from db import result_rows as rr
    from db.models import Experiment, utcnow
    from db.session import writer

    with writer(engine) as s, s.begin():
        exp = Experiment(**rr.spec_columns(spec), status=str(Status.RUNNING), kind=KIND, cancel_requested=False,
                         created_at=utcnow(), started_at=utcnow(), progress_phase="trace")
        s.add(exp)
        s.flush()
        return exp.id


def to_run_result(spec: ExperimentSpec, trace: dict[str, Any]) -> RunResult:
    import torch

    ok = trace["status"] == "ok"
    error = None if ok else (f"unsupported: {trace.get('error')}" if trace["status"] == "unsupported"
                             else trace.get("error"))
    failures = trace.get("failures") or []
    per_rank = [RankResult(rank=r["rank"], coords=r.get("coords", {}),
                           measured=MemoryBreakdown(**_mem(r["traced"]), moment="activation_peak"),
                           predicted=MemoryBreakdown(**_mem(r["predicted"])),
                           error_pct={k: v for k, v in r["error_pct"].items() if k != "other_bytes"})
                for r in trace.get("per_rank", [])]
    summary = {k: v for k, v in trace.items() if k not in ("spec", "per_rank", "failures")}
    summary["ranks"] = [{k: r.get(k) for k in ("rank", "seconds", "max_rss_bytes", "strategy_module")}
                        for r in trace.get("per_rank", [])]
    return RunResult(status=Status.OK if ok else Status.FAILED, error=error, spec=spec, per_rank=per_rank,
                     failing_rank=failures[0].get("rank") if failures else None,
                     traceback=failures[0].get("traceback") if failures else None,
                     env={"kind": KIND, "torch": torch.__version__}, notes=list(trace.get("notes", [])),
                     wall_s=trace.get("seconds"), kind=KIND, trace=summary)


def _mem(d: dict[str, Any]) -> dict[str, int]:
    return {k: int(d.get(k, 0)) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                          "other_bytes", "peak_bytes")}


def finish_trace(engine: Engine, experiment_id: int, spec: ExperimentSpec, trace: dict[str, Any]) -> None:
    from db.models import Experiment
    from db.queries import store_result
    from db.session import writer

    store_result(engine, experiment_id, to_run_result(spec, trace))
    with writer(engine) as s, s.begin():
        s.execute(update(Experiment).where(Experiment.id == experiment_id).values(kind=KIND, progress_phase=None))
