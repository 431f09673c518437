"""Which experiments a read returns: the filters the runs table, `list` and the CSV / JSON export share, and the
tags of a page of rows (one query for the page, not one per row)."""

from __future__ import annotations

from sqlalchemy import Select, exists, or_, select

from db.models import Experiment, ExperimentTag


def filtered(stmt: Select, *, status=None, strategy=None, tag=None, sweep_id=None, search=None,
             framework=None) -> Select:
    if framework:
        stmt = stmt.where(Experiment.framework.in_(as_list(framework)))
    if status:
        stmt = stmt.where(Experiment.status.in_(as_list(status)))
    if strategy:
        stmt = stmt.where(Experiment.strategy.in_(as_list(strategy)))
    if tag:
        for t in as_list(tag):
            stmt = stmt.where(exists().where(ExperimentTag.experiment_id == Experiment.id, ExperimentTag.tag == t))
    if sweep_id:
        stmt = stmt.where(Experiment.sweep_id == sweep_id)
    if search:
        tag_hit = exists().where(ExperimentTag.experiment_id == Experiment.id,
                                 ExperimentTag.tag.icontains(search, autoescape=True))
        conds = [Experiment.name.icontains(search, autoescape=True),
                 Experiment.error.icontains(search, autoescape=True),
                 Experiment.sweep_id.icontains(search, autoescape=True), tag_hit]
        if (run_id := id_in(search)) is not None:
            conds.append(Experiment.id == run_id)
        stmt = stmt.where(or_(*conds))
    return stmt


MAX_ID = 2**63 - 1
"""The largest id a SQLite INTEGER / PostgreSQL BIGINT holds: a longer number searched is text only."""


def id_in(search) -> int | None:
    """The run id a search names: decimal digits within the database's integer range. Before, '99999999999999999999'
    overflowed the driver (a traceback on the Runs page) and '²' (isdigit, not int) raised ValueError."""
    text = str(search).strip()
    if not text.isdecimal():
        return None
    value = int(text)
    return value if value <= MAX_ID else None


def as_list(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, (list, tuple, set, frozenset)) else [str(value)]


def tags_for(conn, ids: list[int]) -> dict[int, list[str]]:
    if not ids:
        return {}
    stmt = (select(ExperimentTag.experiment_id, ExperimentTag.tag)
            .order_by(ExperimentTag.experiment_id, ExperimentTag.tag))
    if len(ids) <= 500:
        stmt = stmt.where(ExperimentTag.experiment_id.in_(ids))
    else:
        stmt = stmt.where(ExperimentTag.experiment_id.between(min(ids), max(ids)))
    wanted, out = set(ids), {}
    for eid, tag in conn.execute(stmt).all():
        if eid in wanted:
            out.setdefault(eid, []).append(tag)
    return out
