"""Alembic migrations of the experiment store, run programmatically by `db.session.init_db`.

`upgrade(engine, revision)` runs inside one BEGIN IMMEDIATE transaction on the caller's engine (on
PostgreSQL: one transaction holding a transaction-level advisory lock), so two processes opening a fresh
database at once migrate it exactly once. On SQLite that connection has foreign keys switched off first
(the pragma is a no-op inside a transaction), as SQLite's own table-rebuild procedure requires: a revision
that recreates `experiments` would otherwise cascade-delete every child row when it drops the old table.

Before upgrading, the store's stamp is checked against its tables (db/migrations/audit.py: revision ids were reused
in ShardLab's history, so a stamp can name a change the store does not hold). A migration that fails for any
reason but an outage raises `SchemaError` (a StoreError: the CLI and the worker exit 2 with it, nothing retries it),
naming the store's stamp and the revision that failed; the transaction rolls back, so the store is unchanged.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from db.begin_immediate import write_engine
from db.errors import SchemaError, is_outage
from db.migrations import audit as audit_

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
    """Upgrade the schema to `revision` (no-op when already there); SchemaError when a revision fails."""
    if revision == "head" and current_revision(engine) == head_revision():
        return
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
                _upgrade_in(conn, cfg, revision)
        finally:
            if sqlite:
                raw.execute("PRAGMA foreign_keys=ON")


def _upgrade_in(conn: Connection, cfg: Config, revision: str) -> None:
    """Audit the stamp, then upgrade, in the caller's transaction; failures other than outages -> SchemaError."""
    script = ScriptDirectory.from_config(cfg)
    where = conn.engine.url.render_as_string(hide_password=True)
    stamped = MigrationContext.configure(conn).get_current_revision()
    try:
        found = audit_.audit(conn, script, stamped)
    except audit_.UnknownRevision:
        raise SchemaError(f"the store {where} is at Alembic revision {stamped!r}, which this version of ShardLab does "
                          f"not have (its newest is {script.get_current_head()}): a newer version wrote it. Open it "
                          "with that version; this one changed nothing") from None
    if found.held != stamped:
        audit_.restamp(conn, found, where)
    applied: list[str] = []
    cfg.attributes["connection"] = conn
    cfg.attributes["on_version_apply"] = [lambda step, **_: applied.append(step.up_revision_id)]
    try:
        command.upgrade(cfg, revision)
    except Exception as e:  # noqa: BLE001 - classified: an outage passes as it is, anything else is the schema
        if is_outage(e):
            raise
        raise SchemaError(_failed(script, found, applied, e, where)) from e


def _failed(script: ScriptDirectory, found: audit_.Audit, applied: list[str], error: Exception, where: str) -> str:
    revisions = audit_.chain(script)
    start = [r.revision for r in revisions].index(found.held) + 1 if found.held else 0
    failing = next((r for r in revisions[start:] if r.revision not in applied), None)
    name = f"revision {failing.revision} ({failing.doc.splitlines()[0].rstrip('.')})" if failing else "the upgrade"
    held = f" (its tables hold revision {found.held} only)" if found.held != found.stamped else ""
    orig = getattr(error, "orig", None) or error
    reason = f"{type(orig).__name__}: {str(orig).strip().splitlines()[0] if str(orig).strip() else ''}"[:300]
    return (f"the store {where} is at Alembic revision {found.stamped or 'none'}{held} and cannot be upgraded to "
            f"{script.get_current_head()}: {name} failed with {reason}. This is the store's schema, not an outage: "
            "retrying will not help. The upgrade ran in one transaction and was rolled back, so the store is "
            "unchanged; open it with the ShardLab version that wrote it, and report this message")
