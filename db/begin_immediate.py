"""How a store transaction begins. SQLite's default BEGIN DEFERRED lets two processes read, then both try to write:
one of them fails. Read-then-write work therefore runs on `write_engine(engine)`, whose transactions begin with
BEGIN IMMEDIATE (db/session.py installs the `begin` hook that reads this option; PostgreSQL ignores it)."""

from __future__ import annotations

from sqlalchemy import Connection, Engine

BEGIN_OPTION = "shardlab_begin"


def write_engine(engine: Engine) -> Engine:
    """The same engine whose transactions start with BEGIN IMMEDIATE on SQLite."""
    return engine.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})


def begin_statement(conn: Connection) -> str:
    return f"BEGIN {conn.get_execution_options().get(BEGIN_OPTION, 'DEFERRED')}"
