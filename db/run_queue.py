"""The queue's state transitions, as the worker drives them: claim a queued run, put it back, record progress and
heartbeats, notice a cancel, store the result (or insert a run that finished elsewhere, imported from its log), and
interrupt runs whose worker stopped. Every write that reads first runs in a BEGIN IMMEDIATE transaction
(`db.session.writer`), so it is atomic across processes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, delete, insert, or_, select, update

from backend.result import RunResult, Status
from backend.spec.user_text import clean_tags
from db import result_rows as rr
from db.models import (
    CommRecord,
    Experiment,
    ExperimentSummary,
    ExperimentTag,
    LossRecord,
    RankResultRow,
    TimelineRecord,
    Worker,
    utcnow,
)
from db.session import writer


class NotFound(LookupError):
    """No experiment with that id."""


@dataclass(frozen=True)
class LeftBehind:
    """What an interrupted run's folder still says (backend/worker/recovery.left_behind): the end of its log and the
    first failing rank's error, stored with the interruption as a stopped worker stores its result's."""

    log_tail: str | None = None
    error: str | None = None
    failing_rank: int | None = None
    traceback: str | None = None


Explain = Callable[[int, str | None], LeftBehind | None]
"""(experiment id, run_uid) -> what its run folder says, if anything."""


def claim_next(engine: Engine, worker_id: str, *, host: str | None = None) -> int | None:
    """Atomically take the oldest queued experiment (BEGIN IMMEDIATE): status -> running. None if the queue is empty."""
    now = utcnow()
    with writer(engine) as s, s.begin():
        stmt = (select(Experiment.id).where(Experiment.status == Status.QUEUED)
                .order_by(Experiment.created_at, Experiment.id).limit(1).with_for_update(skip_locked=True))
        eid = s.execute(stmt).scalar_one_or_none()
        if eid is None:
            return None
        done = s.execute(update(Experiment).where(Experiment.id == eid, Experiment.status == Status.QUEUED).values(
            status=str(Status.RUNNING), worker_id=worker_id, host=host, started_at=now, heartbeat_at=now,
            progress_step=None, progress_total=None, progress_phase=None))
        return eid if done.rowcount == 1 else None


def release_claim(engine: Engine, experiment_id: int, worker_id: str) -> bool:
    """Put a claimed experiment back in the queue (its launch failed because of the host, not the run): running
    -> queued, only while this worker still holds it. True when it went back."""
    with writer(engine) as s, s.begin():
        done = s.execute(update(Experiment).where(
            Experiment.id == experiment_id, Experiment.status == Status.RUNNING,
            Experiment.worker_id == worker_id).values(
            status=str(Status.QUEUED), worker_id=None, host=None, started_at=None, heartbeat_at=None,
            progress_step=None, progress_total=None, progress_phase=None))
        return done.rowcount == 1


def update_progress(engine: Engine, experiment_id: int, step: int | None, total: int | None, phase: str | None) -> bool:
    """Record progress and a heartbeat (values a rank printed are bounded first: an integer step and total, a
    phase of at most 32 plain characters); returns True when a cancel was requested."""
    return heartbeat(engine, experiment_id, progress=(step, total, phase))


def heartbeat(engine: Engine, experiment_id: int, *, worker_id: str | None = None,
              progress: tuple[int | None, int | None, str | None] | None = None) -> bool:
    """One write transaction: the experiment's heartbeat (+ progress (step, total, phase)) and, with worker_id,
    that worker's row as running this experiment. Returns True when a cancel was requested."""
    now = utcnow()
    values: dict[str, Any] = {"heartbeat_at": now}
    if progress is not None:
        values.update(rr.progress_columns(*progress))
    with writer(engine) as s, s.begin():
        s.execute(update(Experiment).where(Experiment.id == experiment_id).values(**values))
        if worker_id is not None:
            s.execute(update(Worker).where(Worker.id == worker_id).values(
                state="running", experiment_id=experiment_id, heartbeat_at=now))
        return bool(s.execute(select(Experiment.cancel_requested).where(Experiment.id == experiment_id)).scalar())


def cancel_requested(engine: Engine, experiment_id: int) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(select(Experiment.cancel_requested).where(Experiment.id == experiment_id)).scalar())


def store_result(engine: Engine, experiment_id: int, result: RunResult) -> None:
    """Store a complete RunResult in ONE transaction: status, summary, rank, comm, loss and timeline rows. The
    experiment's row is locked first (FOR UPDATE; SQLite's BEGIN IMMEDIATE already serialises), so two writers
    storing the same result (a worker and one importing its result.json) follow each other instead of
    colliding on the child rows."""
    with writer(engine) as s, s.begin():
        if s.execute(select(Experiment.id).where(Experiment.id == experiment_id).with_for_update()).first() is None:
            raise NotFound(f"no experiment with id {experiment_id}")
        for model in (RankResultRow, CommRecord, LossRecord, TimelineRecord, ExperimentSummary):
            s.execute(delete(model).where(model.experiment_id == experiment_id))
        _write_result(s, experiment_id, result)


def _write_result(s, experiment_id: int, result: RunResult) -> None:
    s.execute(update(Experiment).where(Experiment.id == experiment_id).values(
        **rr.summary_columns(result), finished_at=utcnow()))
    ranks = rr.rank_rows(experiment_id, result)
    for model, rows in ((RankResultRow, ranks), (CommRecord, rr.comm_rows(experiment_id, result)),
                        (LossRecord, rr.loss_rows(experiment_id, result)),
                        (TimelineRecord, rr.timeline_rows(experiment_id, result)),
                        (ExperimentSummary, [rr.summary_row(experiment_id, result, ranks)])):
        if rows:
            s.execute(insert(model), rows)


def fail_unreadable(engine: Engine, experiment_id: int, reason: str) -> None:
    """Fail a claimed run whose spec this version cannot read (db.queries.read_spec), launching nothing: without a spec
    there is no RunResult, so the row takes the status and the reason and keeps its spec as stored."""
    with writer(engine) as s, s.begin():
        s.execute(update(Experiment).where(Experiment.id == experiment_id, Experiment.status == Status.RUNNING).values(
            status=str(Status.FAILED), error=rr.storable_text(reason), finished_at=utcnow()))


def store_finished_run(engine: Engine, result: RunResult, *, kind: str, tags: Iterable[str] = ()) -> int:
    """Insert a run that finished elsewhere (kind "imported": another framework's log) with its result rows and tags in
    ONE transaction: a failure anywhere leaves nothing behind. Never queued, so no worker can claim it."""
    clean = clean_tags(tags)
    now = utcnow()
    with writer(engine) as s, s.begin():
        exp = Experiment(**rr.spec_columns(result.spec), status=str(result.status), kind=kind, cancel_requested=False,
                         created_at=now, started_at=now)
        exp.tags = [ExperimentTag(tag=t) for t in clean]
        s.add(exp)
        s.flush()
        _write_result(s, exp.id, result)
        return int(exp.id)


def recover_stale(engine: Engine, stale_after_s: float, explain: Explain | None = None) -> list[int]:
    """Mark running experiments whose heartbeat is older than stale_after_s as interrupted; returns their ids.
    explain: what each run's folder says (its log tail, a rank's error), stored with it."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    with writer(engine) as s, s.begin():
        stale = s.scalars(select(Experiment.id).where(
            Experiment.status == Status.RUNNING,
            or_(Experiment.heartbeat_at < cutoff, Experiment.heartbeat_at.is_(None)))).all()
        if stale:
            mark_interrupted(s, stale, f"no heartbeat for more than {stale_after_s:g} s: the worker stopped "
                                       "(killed or crashed)", explain)
    return list(stale)


def mark_interrupted(s, ids: list[int], reason: str, explain: Explain | None = None) -> None:
    """Running experiments -> interrupted with the reason, and with what explain finds in each run's folder."""
    running = s.execute(select(Experiment.id, Experiment.run_uid).where(
        Experiment.id.in_(ids), Experiment.status == Status.RUNNING)).all()
    for eid, uid in running:
        left = explain(eid, uid) if explain is not None else None
        s.execute(update(Experiment).where(Experiment.id == eid).values(**_interrupted(reason, left)))


def _interrupted(reason: str, left: LeftBehind | None) -> dict[str, Any]:
    values: dict[str, Any] = {"status": str(Status.INTERRUPTED), "error": reason, "finished_at": utcnow()}
    if left is not None:
        values.update(error=f"{reason}; {left.error}" if left.error else reason, failing_rank=left.failing_rank,
                      log_tail=rr.storable_text(left.log_tail), traceback=rr.storable_text(left.traceback))
    return values
