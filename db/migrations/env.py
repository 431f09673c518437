"""Alembic environment: reuse the caller's connection (programmatic upgrade) or build one from the URL."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from db.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    # SQLite DDL is transactional: the whole upgrade commits or rolls back with the caller's transaction.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True, compare_type=True,
                      transactional_ddl=True, on_version_apply=config.attributes.get("on_version_apply", ()))
    with context.begin_transaction():
        context.run_migrations()


def _offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from db.session import get_engine, write_engine

    url = (context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
           or os.environ.get("SHARDLAB_DB_URL"))
    with write_engine(get_engine(url)).begin() as conn:
        _run(conn)


if context.is_offline_mode():
    _offline()
else:
    _online()
