"""A trace in the experiment history: an `experiments` row of kind "traced", shown like a run (run page,
Compare, export) with the traced bytes as `measured` next to the prediction.

`begin_trace` makes the row at once (status running, so the runs page shows it while ranks are traced; the
worker only claims queued rows), `finish_trace` stores the outcome through the same `store_result` as a run.
An `unsupported` trace is stored as failed with the torch limitation in its error; the trace's own status
stays in result_json under "trace".

Cancel (the Runs page's Cancel, `python -m backend cancel ID`) sets the row's cancel_requested, as for a run; a trace
has no worker to read it, so the heartbeat thread of `beating` reads it (every CANCEL_POLL_S) and sets the Event it
yields, which the CLI hands to `trace_spec(cancel=...)`. The trace then starts no further rank and kills the rank
process it is waiting on, so it stops within about a second; the row is stored as cancelled (the status a cancelled
run gets) with its spec and the ranks that finished. Why an Event and a killed child rather than
`_thread.interrupt_main()`: every rank is traced in a process of its own that holds nothing but temporary files, so
killing it is always safe, while a KeyboardInterrupt raised at an arbitrary point of the main thread could land in
the store's own write or in the cleanup of the temporary folder, and would not stop the child at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Engine

from backend.result import MemoryBreakdown, RankResult, RunResult, Status
from backend.spec import ExperimentSpec

KIND = "traced"
HEARTBEAT_S = 10.0
"""How often a running trace beats: well inside the workers' 60 s stale_after_s."""
CANCEL_POLL_S = 1.0
"""How often a running trace reads its row's cancel request (the worker polls as often)."""


def begin_trace(engine: Engine, spec: ExperimentSpec) -> int:
    from db import result_rows as rr
    from db.models import Experiment, utcnow
    from db.session import writer

    with writer(engine) as s, s.begin():
        now = utcnow()  # a heartbeat from the start: a running row without one is "interrupted" to the workers
        exp = Experiment(**rr.spec_columns(spec), status=str(Status.RUNNING), kind=KIND, cancel_requested=False,
                         created_at=now, started_at=now, heartbeat_at=now, progress_phase="trace")
        s.add(exp)
        s.flush()
        return exp.id


@contextmanager
def beating(engine: Engine, experiment_id: int, every_s: float = HEARTBEAT_S,
            poll_s: float = CANCEL_POLL_S) -> Iterator[threading.Event]:
    """The trace's row beats while the trace runs; yields an Event set once the row's cancel is requested. A worker's
    recovery judges a running row whose heartbeat is older than its stale_after_s (60 s) interrupted by a dead worker;
    a trace has no worker, so before, any trace was marked interrupted (the worker stopped) by the next recovery
    round, until its result overwrote that."""
    stop, cancel = threading.Event(), threading.Event()
    thread = threading.Thread(target=_beat, args=(engine, experiment_id, every_s, poll_s, stop, cancel),
                              name=f"trace-{experiment_id}-heartbeat", daemon=True)
    thread.start()
    try:
        yield cancel
    finally:
        stop.set()
        thread.join(timeout=every_s)


def _beat(engine: Engine, experiment_id: int, every_s: float, poll_s: float, stop: threading.Event,
          cancel: threading.Event) -> None:
    """Heartbeat every every_s, read the cancel request every poll_s, until stop."""
    from db.queries import cancel_requested, heartbeat

    last = time.monotonic()
    while not stop.wait(min(every_s, poll_s)):
        try:
            if time.monotonic() - last >= every_s:
                requested = heartbeat(engine, experiment_id)
                last = time.monotonic()
            else:
                requested = cancel_requested(engine, experiment_id)
        except Exception:  # noqa: BLE001 - a store outage: the next beat tries again
            continue
        if requested:
            cancel.set()


def to_run_result(spec: ExperimentSpec, trace: dict[str, Any]) -> RunResult:
    import torch

    ok = trace["status"] == "ok"
    error = None if ok else (f"unsupported: {trace.get('error')}" if trace["status"] == "unsupported"
                             else trace.get("error"))
    status = Status.OK if ok else (Status.CANCELLED if trace["status"] == str(Status.CANCELLED) else Status.FAILED)
    failures = trace.get("failures") or []
    per_rank = [RankResult(rank=r["rank"], coords=r.get("coords", {}),
                           measured=MemoryBreakdown(**_mem(r["traced"]), moment="activation_peak"),
                           predicted=MemoryBreakdown(**_mem(r["predicted"])),
                           error_pct={k: v for k, v in r["error_pct"].items() if k != "other_bytes"})
                for r in trace.get("per_rank", [])]
    summary = {k: v for k, v in trace.items() if k not in ("spec", "per_rank", "failures")}
    summary["ranks"] = [{k: r.get(k) for k in ("rank", "seconds", "max_rss_bytes", "strategy_module")}
                        for r in trace.get("per_rank", [])]
    return RunResult(status=status, error=error, spec=spec, per_rank=per_rank,
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
