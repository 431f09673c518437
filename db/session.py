"""Engines and transactions for the experiment store.

The database URL comes from the argument, else `SHARDLAB_DB_URL`, else the SQLite file
`<repo>/data/shardlab.db` (DEFAULT_DB_PATH; the folder is created on first use).

SQLite is tuned for one writing worker next to polling readers (see /work/shared/MACHINE_FACTS.md):
WAL journal, synchronous=NORMAL, busy_timeout, foreign keys on. pysqlite's own transaction handling is
switched off (`isolation_level=None`) and SQLAlchemy's `begin` event emits the BEGIN itself: plain
`BEGIN` (deferred) for reads, `BEGIN IMMEDIATE` for writes (`writer(engine)`), so a read-then-write
such as a job claim holds the write lock from its first statement and two workers cannot both claim
the same row; a deferred write transaction could also fail with SQLITE_BUSY_SNAPSHOT, which
busy_timeout does not retry.

PostgreSQL (`postgresql+psycopg://user@host:port/db`, a team's shared store) runs the same Alembic
migrations (serialised by an advisory lock, db/migrations) and needs no BEGIN IMMEDIATE: transactions are
READ COMMITTED and the job claim takes its row with `SELECT ... FOR UPDATE SKIP LOCKED` (db.queries.claim_next),
so concurrent workers skip a row another worker is claiming instead of waiting for it or taking it twice.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DB_PATH = REPO / "data" / "shardlab.db"
ENV_URL = "SHARDLAB_DB_URL"
BUSY_TIMEOUT_MS = 30_000
_BEGIN_OPTION = "shardlab_begin"

_engines: dict[str, Engine] = {}
_migrated: set[str] = set()
_lock = threading.Lock()


def resolve_url(url: str | None = None) -> str:
    return url or os.environ.get(ENV_URL) or f"sqlite:///{DEFAULT_DB_PATH}"


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other backends or in-memory SQLite."""
    u = make_url(url)
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return None
    return Path(u.database)


def get_engine(url: str | None = None) -> Engine:
    """One cached engine per URL (schema not touched: see `init_db` / `open_db`)."""
    url = resolve_url(url)
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _create(url)
        return engine


def _create(url: str) -> Engine:
    path = sqlite_path(url)
    if not make_url(url).drivername.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})
    _tune_sqlite(engine, wal=path is not None)
    return engine


def _tune_sqlite(engine: Engine, *, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if wal:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get(_BEGIN_OPTION, 'DEFERRED')}")


def write_engine(engine: Engine) -> Engine:
    """The same engine whose transactions start with BEGIN IMMEDIATE on SQLite."""
    return engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})


def writer(engine: Engine) -> Session:
    """A Session for read-then-write work: `with writer(engine) as s, s.begin(): ...`."""
    return Session(write_engine(engine), expire_on_commit=False)


def reader(engine: Engine) -> Session:
    return Session(engine, expire_on_commit=False)


def init_db(engine: Engine) -> Engine:
    """Create or upgrade the schema to the newest Alembic revision (a user's history survives upgrades)."""
    key = str(engine.url)
    if key in _migrated:
        return engine
    from db.migrations import upgrade

    upgrade(engine, "head")
    _migrated.add(key)
    return engine


def open_db(url: str | None = None) -> Engine:
    """`get_engine` + `init_db`: what the CLI, worker and dashboard call."""
    return init_db(get_engine(url))


def forget_engines() -> None:
    """Dispose cached engines (tests, and after fork)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _migrated.clear()
