"""Alembic migrations of the experiment store, run programmatically by `db.session.init_db`.

`upgrade(engine, revision)` runs inside one BEGIN IMMEDIATE transaction on the caller's engine (on
PostgreSQL: one transaction holding a transaction-level advisory lock), so two processes opening a fresh
database at once migrate it exactly once. On SQLite that connection has foreign keys switched off first
(the pragma is a no-op inside a transaction), as SQLite's own table-rebuild procedure requires: a revision
that recreates `experiments` would otherwise cascade-delete every child row when it drops the old table.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

HERE = Path(__file__).resolve().parent
INI = HERE.parent / "alembic.ini"
MIGRATION_LOCK_ID = 0x5AD1AB  # pg_advisory_xact_lock key of ShardLab's schema migrations


def alembic_config(engine: Engine | None = None) -> Config:
    cfg = Config(str(INI))
    cfg.set_main_option("script_location", str(HERE))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to `revision` (no-op when already there)."""
    if revision == "head" and current_revision(engine) == head_revision():
        return
    from db.session import write_engine

    cfg = alembic_config(engine)
    with write_engine(engine).connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        raw = conn.connection.driver_connection
        if sqlite:
            raw.execute("PRAGMA foreign_keys=OFF")  # before BEGIN: see the module docstring
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    # DDL is transactional here too, but two fresh migrations would both CREATE TABLE: serialise
                    # them; alembic reads the version after the lock, so the second one finds the schema at head.
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})")
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
        finally:
            if sqlite:
                raw.execute("PRAGMA foreign_keys=ON")
