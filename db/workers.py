"""Worker bookkeeping: one `workers` row per worker process (state + heartbeat), shown by the dashboard
and used at start-up to interrupt at once the jobs of a worker on this host whose process is gone."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psutil
from sqlalchemy import Engine, delete, select, update

from backend.result import Status
from db.models import Experiment, Worker, utcnow
from db.run_queue import Explain, mark_interrupted
from db.session import writer

PRUNE_AFTER = timedelta(days=7)


def register_worker(engine: Engine, worker_id: str, *, pid: int, host: str, pid_started: float | None) -> None:
    """Add (or reset) this worker's row; rows of workers stopped or dead for a week are pruned."""
    now = utcnow()
    with writer(engine) as s, s.begin():
        s.execute(delete(Worker).where(Worker.state.in_(("stopped", "dead")), Worker.heartbeat_at < now - PRUNE_AFTER))
        s.merge(Worker(id=worker_id, pid=pid, host=host, pid_started=pid_started, state="idle", experiment_id=None,
                       started_at=now, heartbeat_at=now))


def set_worker_state(engine: Engine, worker_id: str, state: str, experiment_id: int | None = None) -> None:
    """Heartbeat the worker row with its state: idle | running | stopped."""
    with writer(engine) as s, s.begin():
        s.execute(update(Worker).where(Worker.id == worker_id).values(
            state=state, experiment_id=experiment_id, heartbeat_at=utcnow()))


def worker_heartbeats(engine: Engine, *, stale_after_s: float = 60.0) -> list[dict[str, Any]]:
    """Workers newest first: id, pid, host, state, experiment_id, started_at, heartbeat_at, age_s, alive
    (alive = not stopped and heartbeat younger than stale_after_s)."""
    now = utcnow()
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(
            select(Worker.id, Worker.pid, Worker.host, Worker.state, Worker.experiment_id, Worker.started_at,
                   Worker.heartbeat_at).order_by(Worker.heartbeat_at.desc()))]
    for r in rows:
        r["age_s"] = (now - r["heartbeat_at"]).total_seconds()
        r["alive"] = r["state"] != "stopped" and r["age_s"] < stale_after_s
    return rows


def _process_gone(pid: int, pid_started: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return pid_started is not None and abs(proc.create_time() - pid_started) > 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def mark_dead_workers(engine: Engine, host: str) -> list[str]:
    """Mark `dead` the workers on `host` whose process no longer exists; returns their ids. Workers already
    marked stopped or dead are not looked at again."""
    with writer(engine) as s, s.begin():
        workers = s.execute(select(Worker).where(Worker.host == host,
                                                 Worker.state.not_in(("stopped", "dead")))).scalars().all()
        dead = [w for w in workers if _process_gone(w.pid, w.pid_started)]
        for w in dead:
            w.state = "dead"
        return [w.id for w in dead]


def interrupt_jobs_of_dead_workers(engine: Engine, host: str, explain: Explain | None = None) -> list[int]:
    """Interrupt the running experiments of workers on `host` marked dead; returns their ids. Call it after
    importing the results those workers left on disk (backend/worker/recovery.py). explain: what each run's folder
    says (its log tail, a rank's error), stored with it."""
    with writer(engine) as s, s.begin():
        dead = select(Worker.id).where(Worker.host == host, Worker.state == "dead")
        ids = s.scalars(select(Experiment.id).where(Experiment.status == Status.RUNNING,
                                                    Experiment.worker_id.in_(dead))).all()
        if ids:
            mark_interrupted(s, list(ids), "the worker process died while the job was running (killed or crashed)",
                             explain)
        return list(ids)


def recover_dead_workers(engine: Engine, host: str) -> list[int]:
    """Interrupt the running experiments of workers on `host` whose process no longer exists; returns their ids."""
    mark_dead_workers(engine, host)
    return interrupt_jobs_of_dead_workers(engine, host)


def process_gone(pid: int, pid_started: float | None) -> bool:
    """Whether the process of a worker row is gone (dead, a zombie, or its pid recycled by another process)."""
    return _process_gone(pid, pid_started)


def gone_worker_ids(engine: Engine, host: str, stale_after_s: float | None) -> set[str]:
    """Workers that can no longer be working on anything: stopped or dead, a process gone on this host, or (with
    stale_after_s) silent for longer than that."""
    now = utcnow()
    with engine.connect() as conn:
        rows = conn.execute(select(Worker.id, Worker.host, Worker.pid, Worker.pid_started, Worker.state,
                                   Worker.heartbeat_at)).all()
    return {r.id for r in rows if r.state in ("stopped", "dead")
            or (r.host == host and _process_gone(r.pid, r.pid_started))
            or (stale_after_s is not None and (now - r.heartbeat_at).total_seconds() > stale_after_s)}
