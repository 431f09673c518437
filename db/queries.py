"""The experiment store's API: the dashboard, CLI and worker use only these functions.

Every function takes an Engine (`db.session.open_db(url)` gives a migrated one). Rows come back as
plain dicts (ROW_KEYS + "tags"); timestamps are timezone-aware UTC datetimes. Writes that read first
run in a BEGIN IMMEDIATE transaction (`db.session.writer`), so they are atomic across processes.

Re-queueing clones: `requeue_experiment` inserts a NEW queued row with the same spec, tags and sweep
(`requeue_of` points at the original), so a failed/interrupted run stays in the history as a result.

This module holds what people do with runs (submit, read, tag, cancel, re-queue, delete); it also re-exports the
queue's transitions (db/run_queue.py) and the worker rows (db/workers.py), so callers need this one module.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Engine, delete, func, insert, select

from backend.result import FINISHED, RunResult, Status
from backend.spec import READ_BACK, ExperimentSpec, validate_spec  # READ_BACK: re-exported as the store's API
from backend.spec.dims import DIMS, placed_columns
from backend.spec.user_text import clean_tags
from db import result_rows as rr
from db.degrees import column
from db.filters import filtered, tags_for
from db.models import Experiment, ExperimentTag, utcnow
from db.run_queue import (  # noqa: F401 - API
    Explain,
    LeftBehind,
    NotFound,
    cancel_requested,
    claim_next,
    fail_unreadable,
    heartbeat,
    mark_interrupted,
    recover_stale,
    release_claim,
    store_finished_run,
    store_result,
    update_progress,
)
from db.session import reader, writer
from db.workers import recover_dead_workers, register_worker, set_worker_state, worker_heartbeats  # noqa: F401 - API

ROW_KEYS = tuple(placed_columns((  # + the parallel dimensions' columns (backend/spec/dims.py, read by db/degrees.py)
    "id", "name", "status", "strategy", "world_size",
    "zero_stage",
    "microbatches", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn",
    "seq_len", "vocab", "n_experts", "top_k", "global_batch", "micro_batch", "steps", "precision", "optimizer",
    "recompute", "sweep_id", "requeue_of", "cancel_requested", "created_at", "started_at", "finished_at",
    "heartbeat_at", "worker_id", "host", "progress_step", "progress_total", "progress_phase", "error",
    "failing_rank", "step_s_median", "tokens_per_s", "loss_max_abs_diff", "bubble_measured", "bubble_predicted",
    "peak_bytes_max", "mfu", "wall_s",
    "kind",  # revision 0004: measured | traced | imported (issue 25)
    "framework",
    "source_framework", "peak_allocated_bytes", "peak_reserved_bytes",  # revision 0009: imported runs
    "diverged",  # a loss NaN or inf (issue 31): computed from the losses rows (models.Experiment.diverged)
), DIMS))
ORDER_KEYS = frozenset(ROW_KEYS)
REQUEUEABLE = tuple(str(s) for s in FINISHED)


# ---- submit and tags -------------------------------------------------------------------------------

def submit_experiment(engine: Engine, spec: ExperimentSpec, *, tags: Iterable[str] = (), sweep_id: str | None = None,
                      requeue_of: int | None = None) -> int:
    """Queue a validated spec; returns the new experiment id."""
    return submit_experiments(engine, [spec], tags=tags, sweep_id=sweep_id, requeue_of=requeue_of)[0]


def submit_experiments(engine: Engine, specs: Iterable[ExperimentSpec], *, tags: Iterable[str] = (),
                       sweep_id: str | None = None, requeue_of: int | None = None) -> list[int]:
    """Queue several specs in one transaction (all or none); returns their ids in order."""
    clean = _clean_tags(tags)
    with writer(engine) as s, s.begin():
        exps = []
        for spec in specs:
            exp = Experiment(**rr.spec_columns(spec), status=str(Status.QUEUED), sweep_id=sweep_id,
                             cancel_requested=False, created_at=utcnow(), requeue_of=requeue_of)
            exp.tags = [ExperimentTag(tag=t) for t in clean]
            exps.append(exp)
        s.add_all(exps)
        s.flush()
        return [e.id for e in exps]


def set_tags(engine: Engine, experiment_id: int, tags: Iterable[str]) -> list[str]:
    """Replace the experiment's tags (stored verbatim; empty strings and duplicates dropped; InputError for a tag
    too long or with control characters, backend/spec/user_text.py)."""
    clean = _clean_tags(tags)
    with writer(engine) as s, s.begin():
        _require(s, experiment_id)
        s.execute(delete(ExperimentTag).where(ExperimentTag.experiment_id == experiment_id))
        if clean:
            s.execute(insert(ExperimentTag), [{"experiment_id": experiment_id, "tag": t} for t in clean])
    return clean


def _clean_tags(tags: Iterable[str]) -> list[str]:
    """Empty strings and duplicates dropped; InputError (a ValueError) for a tag the spec's text rules refuse."""
    return clean_tags(tags)


def _require(s, experiment_id: int) -> Experiment:
    exp = s.get(Experiment, experiment_id)
    if exp is None:
        raise NotFound(f"no experiment with id {experiment_id}")
    return exp


# ---- reading ---------------------------------------------------------------------------------------

def list_experiments(engine: Engine, *, status=None, strategy=None, tag=None, sweep_id=None, search=None,
                     framework=None, limit: int | None = None, offset: int = 0, order_by: str = "created_at",
                     descending: bool = True, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Flat rows (ROW_KEYS + "tags": list[str]). status/strategy/tag accept one value or a list
    (tag: every listed tag must be present); search matches name, error, sweep id, tags or the id.
    columns: only these keys ("id" always; "tags" only when listed), e.g. the ~20 a table shows: reading
    fewer of the 51 columns is what makes 10,000 rows cheap."""
    if order_by not in ORDER_KEYS:
        raise ValueError(f"order_by={order_by!r} is not a column; choose one of {sorted(ORDER_KEYS)}")
    keys, with_tags = _row_keys(columns)
    col = column(order_by)
    stmt = filtered(select(*[column(k) for k in keys]), status=status, strategy=strategy, tag=tag,
                     sweep_id=sweep_id, search=search, framework=framework)
    stmt = stmt.order_by(col.desc() if descending else col.asc(),
                         Experiment.id.desc() if descending else Experiment.id.asc())
    if limit is not None:
        stmt = stmt.limit(limit)
    if offset:
        stmt = stmt.offset(offset)
    with engine.connect() as conn:
        rows = [dict(zip(keys, r, strict=False))
                for r in conn.execute(stmt).all()]  # one fetchall, not a fetchone per row
        if with_tags:
            tags = tags_for(conn, [r["id"] for r in rows])
            for r in rows:
                r["tags"] = tags.get(r["id"], [])
    return rows


def _row_keys(columns: Iterable[str] | None) -> tuple[tuple[str, ...], bool]:
    """(selected ROW_KEYS with "id" first, whether tags are wanted) for list_experiments' columns."""
    if columns is None:
        return ROW_KEYS, True
    wanted = [columns] if isinstance(columns, str) else list(columns)
    unknown = sorted(set(wanted) - ORDER_KEYS - {"tags"})
    if unknown:
        raise ValueError(f"columns {unknown} are not experiment columns; choose from {sorted(ORDER_KEYS | {'tags'})}")
    return tuple(dict.fromkeys(["id", *(k for k in wanted if k != "tags")])), "tags" in wanted


def count_experiments(engine: Engine, *, status=None, strategy=None, tag=None, sweep_id=None, search=None,
                      framework=None) -> int:
    stmt = filtered(select(func.count(Experiment.id)), status=status, strategy=strategy, tag=tag, sweep_id=sweep_id,
                     search=search, framework=framework)
    with engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one())


def get_experiment(engine: Engine, experiment_id: int) -> dict[str, Any] | None:
    """ROW_KEYS + tags + log_tail, traceback, run_uid, env (dict), "spec" (ExperimentSpec | None), "spec_error" (why
    this version cannot read the stored spec, else None; then "spec_json" holds it as stored), "result" (RunResult |
    None), "result_error" (why a stored result does not read, else None)."""

    extra = (Experiment.log_tail, Experiment.traceback, Experiment.env_json, Experiment.spec_json,
             Experiment.result_json, Experiment.run_uid)
    stmt = select(*[column(k) for k in ROW_KEYS], *extra).where(Experiment.id == experiment_id)
    with engine.connect() as conn:
        row = conn.execute(stmt).first()
        if row is None:
            return None
        out = dict(row._mapping)
        out["tags"] = tags_for(conn, [experiment_id]).get(experiment_id, [])
    out["env"] = json.loads(out.pop("env_json") or "{}")
    spec_json = out.pop("spec_json")
    out["spec"], out["spec_error"] = read_spec(spec_json)
    if out["spec_error"] is not None:
        out["spec_json"] = spec_json  # nothing is lost: shown as stored
    out["result"], out["result_error"] = read_result(out.pop("result_json"))
    return out


def read_spec(spec_json: str) -> tuple[ExperimentSpec | None, str | None]:
    """(the stored spec, None), or (None, why this version cannot read it). Read back (READ_BACK), a spec that an older
    version stored is not held to rules added since; only one whose types this version lacks (a field or a value
    removed since) does not read, and its row still lists, shows and fails with the reason instead of raising."""
    try:
        return ExperimentSpec.model_validate_json(spec_json, context=READ_BACK), None
    except ValueError as e:  # pydantic's ValidationError, or JSON that does not parse
        return None, f"this run's spec cannot be read by this version: {_why(e)}"


def read_result(result_json: str | None) -> tuple[RunResult | None, str | None]:
    """(the stored result, None), or (None, why it does not read): one unreadable row must never break a page or
    a command that shows it (issue 31: a NaN loss written as null made `show` fail before losses were kept)."""
    if not result_json:
        return None, None
    try:
        return RunResult.model_validate_json(result_json, context=READ_BACK), None
    except ValueError as e:  # pydantic's ValidationError, or JSON that does not parse
        return None, f"the stored result does not read ({_why(e)})"


def _why(error: ValueError) -> str:
    """'ValidationError: model.gone: Extra inputs are not permitted': up to 3 problems, bounded."""
    if isinstance(error, ValidationError):
        lines = [f"{'.'.join(str(x) for x in e['loc']) or 'the JSON'}: {e['msg']}" for e in error.errors()]
    else:
        lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {'; '.join(lines[:3])[:400]}"


def get_status(engine: Engine, experiment_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(Experiment.status).where(Experiment.id == experiment_id)).scalar_one_or_none()


# ---- lifecycle -------------------------------------------------------------------------------------

def cancel_experiment(engine: Engine, experiment_id: int) -> str:
    """queued -> "cancelled" at once; running -> "cancelling" (cancel_requested set, the worker, or for a trace its
    own process, stops the job and stores it as cancelled); any finished status is returned unchanged."""
    with writer(engine) as s, s.begin():
        exp = _require(s, experiment_id)
        return _cancel(exp) or exp.status


def cancel_live_experiment(engine: Engine, experiment_id: int) -> str:
    """cancel_experiment for one run a person named (`cancel ID`): a finished run raises ValueError naming its status,
    where returning the status ("ok") read as "cancelled ok"."""
    with writer(engine) as s, s.begin():
        exp = _require(s, experiment_id)
        if (said := _cancel(exp)) is None:
            raise ValueError(f"experiment {experiment_id} already finished (status {exp.status}): nothing was "
                             "cancelled")
        return said


def _cancel(exp: Experiment) -> str | None:
    """Cancel a queued or running row in its session: "cancelled" or "cancelling"; None for a finished one."""
    if exp.status == Status.QUEUED:
        exp.status, exp.finished_at, exp.error = str(Status.CANCELLED), utcnow(), "cancelled before it started"
        exp.cancel_requested = True
        return str(Status.CANCELLED)
    if exp.status == Status.RUNNING:
        exp.cancel_requested = True
        return "cancelling"
    return None


def requeue_experiment(engine: Engine, experiment_id: int) -> int:
    """Queue a finished experiment again as a NEW row (same spec, tags, sweep); returns the new id."""
    with reader(engine) as s:
        exp = _require(s, experiment_id)
        if exp.kind == "imported":
            raise ValueError(f"experiment {experiment_id} was imported from a {exp.source_framework} log: it ran "
                             "elsewhere, so it cannot be re-queued here (Open in New experiment to run its spec)")
        if exp.kind == "traced":  # re-queued, it became a real run of the full-size spec, not a trace
            raise ValueError(f"experiment {experiment_id} is a trace (fake tensors, nothing ran): re-queued it would "
                             "be a real run of its full-size spec; trace it again instead (Edit as new, then Trace "
                             "at full size; or `python -m backend trace --spec S.json --store`)")
        if exp.status not in REQUEUEABLE:
            raise ValueError(f"experiment {experiment_id} is {exp.status}: only finished runs "
                             f"({', '.join(REQUEUEABLE)}) can be re-queued")
        (spec, problems), tags, sweep = validate_spec(exp.spec_json), [t.tag for t in exp.tags], exp.sweep_id
    if spec is None:  # a new run is held to today's rules, which an older version's spec may break
        raise ValueError(f"experiment {experiment_id} cannot be re-queued: this version refuses its spec as a new run "
                         f"({'; '.join(problems)}); Edit as new on the Runs page to change it")
    return submit_experiment(engine, spec, tags=tags, sweep_id=sweep, requeue_of=experiment_id)


def delete_experiment(engine: Engine, experiment_id: int) -> dict[str, Any]:
    """Delete an experiment and all its result rows. A running one must be cancelled first. Returns what locates
    its run folder ({"id", "run_uid", "executor"}): backend.worker.cleanup.delete_run removes that too."""
    with writer(engine) as s, s.begin():
        exp = _require(s, experiment_id)
        if exp.status == Status.RUNNING:
            raise ValueError(f"experiment {experiment_id} is running: cancel it before deleting")
        gone = {"id": exp.id, "run_uid": exp.run_uid, "executor": _executor(exp.spec_json)}
        s.delete(exp)
    return gone


def _executor(spec_json: str) -> str:
    try:
        return str((json.loads(spec_json).get("runtime") or {}).get("executor") or "local")
    except (ValueError, AttributeError):
        return "local"


def run_uids(engine: Engine, ids: Iterable[int] | None = None) -> dict[int, str]:
    """{experiment id: run_uid} of the given experiments (every experiment when ids is None)."""
    stmt = select(Experiment.id, Experiment.run_uid)
    if ids is not None:
        stmt = stmt.where(Experiment.id.in_(list(ids)))
    with engine.connect() as conn:
        return {eid: uid for eid, uid in conn.execute(stmt).all()}


