"""SLURM jobs outlive the worker that submitted them. A stopping worker detaches from its SLURM jobs (they keep
running; the experiment stays `running`), and a starting worker adopts every running SLURM experiment whose
worker is gone (stopped, dead, or a process that no longer exists on this host), then follows the job recorded
in the run's slurm.json as if it had submitted it (backend.cluster.runner re-attaches instead of resubmitting).
"""

from __future__ import annotations

import json

from sqlalchemy import Engine, select, update

from backend.result import Status
from db.models import Experiment, Worker, utcnow
from db.session import writer


class Detached(Exception):
    """The worker is stopping: the SLURM job keeps running and is adopted by the next worker."""


def _executor(spec_json: str) -> str | None:
    return (json.loads(spec_json).get("runtime") or {}).get("executor")


def _gone(w: Worker | None, host: str, stale_after_s: float) -> bool:
    from db.workers import process_gone

    if w is None or w.state in ("stopped", "dead"):
        return True
    if w.host == host and process_gone(w.pid, w.pid_started):
        return True
    return (utcnow() - w.heartbeat_at).total_seconds() > stale_after_s


def adopt(engine: Engine, worker_id: str, host: str, *, stale_after_s: float = 60.0) -> list[int]:
    """Take over the running SLURM experiments of gone workers (worker_id, heartbeat now); returns their ids."""
    with writer(engine) as s, s.begin():
        rows = s.execute(select(Experiment.id, Experiment.worker_id, Experiment.spec_json)
                         .where(Experiment.status == Status.RUNNING)).all()
        slurm_rows = [(eid, wid) for eid, wid, spec in rows if _executor(spec) == "slurm"]
        workers = {w.id: w for w in s.scalars(select(Worker).where(Worker.id.in_([wid for _, wid in slurm_rows])))}
        ids = [eid for eid, wid in slurm_rows if _gone(workers.get(wid), host, stale_after_s)]
        if ids:
            s.execute(update(Experiment).where(Experiment.id.in_(ids)).values(
                worker_id=worker_id, host=host, heartbeat_at=utcnow()))
    return ids
