"""Additive schema operations that skip what a store already has, for revisions that can meet a store holding their
change before its stamp says so.

ShardLab's history reused revision ids: parallel branches numbered their revisions alike, and the merges renumbered
them (db/migrations/landed.py lists every id and what it meant). A store stamped "0007" by 8d72316 holds
`experiment_summaries.step_time_predicted_s` (today's 0008) and lacks today's 0007 (`run_uid`). db.migrations.audit
re-stamps such a store at the last revision whose changes it really holds; the revisions above it then meet changes
already made, and skip them here instead of failing ("duplicate column name").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def _inspector() -> sa.Inspector:
    return sa.inspect(op.get_bind())  # a fresh one each time: the schema changes between calls


def has_table(name: str) -> bool:
    return _inspector().has_table(name)


def has_column(table: str, column: str) -> bool:
    return any(c["name"] == column for c in _inspector().get_columns(table))


def has_index(table: str, name: str) -> bool:
    return any(i["name"] == name for i in _inspector().get_indexes(table))


def add_column(table: str, column: sa.Column) -> None:
    """A plain ADD COLUMN (never a batch copy of the table: on SQLite that would cascade into child rows)."""
    if not has_column(table, column.name):
        op.add_column(table, column)


def create_table(name: str, *columns: sa.Column) -> None:
    if not has_table(name):
        op.create_table(name, *columns)


def create_index(name: str, table: str, columns: list[str], **kw) -> None:
    if not has_index(table, name):
        op.create_index(name, table, columns, **kw)
