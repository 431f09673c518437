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

A SQLite store is one file, and a file can vanish under a running process: the worker then wrote to a deleted
inode and a later CLI call silently created an empty store at the same path. So the first open of a path writes
a marker beside it (`<file>.id`) and records the file's (device, inode); every transaction checks the path
still holds that inode (`StoreGone` otherwise), pooled connections open the file read-write without creating
it, and a path whose marker exists but whose file does not is refused (`StoreMissing`) instead of being
re-created empty. A path used for the first time is created as before.

PostgreSQL (`postgresql+psycopg://user@host:port/db`, a team's shared store) runs the same Alembic
migrations (serialised by an advisory lock, db/migrations) and needs no BEGIN IMMEDIATE: transactions are
READ COMMITTED and the job claim takes its row with `SELECT ... FOR UPDATE SKIP LOCKED` (db.queries.claim_next),
so concurrent workers skip a row another worker is claiming instead of waiting for it or taking it twice.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session

from db.begin_immediate import begin_statement, write_engine
from db.errors import StoreError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DB_PATH = REPO / "data" / "shardlab.db"
ENV_URL = "SHARDLAB_DB_URL"
BUSY_TIMEOUT_MS = 30_000
BUSY_SLICE_MS = 500
"""A BEGIN waits for a lock in slices this long, re-reading the stop bound between them (_begin_within_bound)."""

_engines: dict[str, Engine] = {}
_migrated: set[str] = set()
_identity: dict[str, tuple[int, int]] = {}
"""SQLite URL -> (st_dev, st_ino) of the file its cached engine opened."""
_wait_until: dict[str, float] = {}
"""SQLite URL -> time.monotonic() after which no transaction waits for a lock (bound_waits)."""
_lock = threading.Lock()


class StoreMissing(StoreError):
    """A SQLite store that was created before is gone: refusing to create an empty one in its place."""


class StoreGone(StoreError):
    """The SQLite file this process opened was removed or replaced while it ran."""


def resolve_url(url: str | None = None) -> str:
    return url or os.environ.get(ENV_URL) or f"sqlite:///{DEFAULT_DB_PATH}"


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other backends or in-memory SQLite."""
    u = make_url(url)
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return None
    return Path(u.database)


def get_engine(url: str | None = None) -> Engine:
    """One cached engine per URL (schema not touched: see `init_db` / `open_db`). A SQLite file replaced since
    the cached engine opened it gets a new engine here (the old one keeps raising StoreGone for its holders)."""
    url = resolve_url(url)
    with _lock:
        engine = _engines.get(url)
        if engine is not None and url in _identity and _file_identity(sqlite_path(url)) not in (None, _identity[url]):
            engine.dispose()
            engine = None
            _migrated.discard(url)
        if engine is None:
            engine = _engines[url] = _create_or_refuse(url)
        return engine


class StoreUrlError(StoreError):
    """The store URL cannot be opened as written: not a URL, an unknown database, a driver not installed, or a
    SQLite folder that cannot be created."""


URL_EXAMPLES = ("e.g. sqlite:////absolute/path/shardlab.db or postgresql+psycopg://user:pass@host/db "
                f"(--db, else ${ENV_URL})")


def _create_or_refuse(url: str) -> Engine:
    """`_create`, with a URL that cannot work said in words (StoreUrlError) instead of a driver's traceback. The
    message never quotes the URL: it may hold a password."""
    try:
        return _create(url)
    except ArgumentError as e:  # not a URL, or an unknown dialect (NoSuchModuleError)
        raise StoreUrlError(f"the store URL cannot be opened ({e}); {URL_EXAMPLES}") from e
    except ModuleNotFoundError as e:
        raise StoreUrlError(f"the store URL needs the database driver {e.name!r}, which is not installed; "
                            f"{URL_EXAMPLES}") from e


def marker_path(path: Path) -> Path:
    """Beside a SQLite store: remembers that the store was created, so its loss is noticed."""
    return path.with_name(path.name + ".id")


def _file_identity(path: Path | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path is not None else None
    except FileNotFoundError:
        return None
    return None if st is None else (st.st_dev, st.st_ino)


def _first_use_or_refuse(path: Path) -> None:
    """Create the store file on first use; refuse to re-create one whose marker says it existed."""
    marker = marker_path(path)
    if path.is_dir():
        raise StoreUrlError(f"the SQLite store {path} is a folder, not a database file; {URL_EXAMPLES}")
    if not path.exists():
        if marker.exists():
            try:
                created = json.loads(marker.read_text()).get("created_at", "?")
            except (OSError, ValueError):
                created = "?"
            raise StoreMissing(f"the SQLite store {path} is gone (created {created}; {marker} remembers it). ShardLab "
                               f"will not silently start an empty store in its place: restore the file, or delete "
                               f"{marker} to start a new, empty store at that path")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            sqlite3.connect(path).close()
        except (OSError, sqlite3.Error) as e:
            raise StoreUrlError(f"cannot create the SQLite store {path} ({e}): give a path in a folder this user can "
                                f"create or write; {URL_EXAMPLES}") from e
    if not marker.exists():
        try:
            marker.write_text(json.dumps({"created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                          "path": str(path)}))
        except OSError:
            pass  # a read-only folder: the store still works, its loss just is not remembered


def _create(url: str) -> Engine:
    path = sqlite_path(url)
    if not make_url(url).drivername.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    if path is None:  # in-memory
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})
        _tune_sqlite(engine, wal=False)
        return engine
    _first_use_or_refuse(path)
    _identity[url] = _file_identity(path)
    uri = path.resolve().as_uri() + "?mode=rw"  # never create: a vanished file must not come back empty

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)

    engine = create_engine(url, creator=connect)
    _tune_sqlite(engine, wal=True, path=path, identity=_identity[url])
    return engine


def check_store_file(path: Path, identity: tuple[int, int] | None) -> None:
    """Raise StoreGone when `path` no longer holds the file (device, inode) this process opened."""
    now = _file_identity(path)
    if now == identity:
        return
    what = "was removed" if now is None else f"was replaced by another file (inode {identity[1]} -> {now[1]})"
    raise StoreGone(f"the SQLite store {path} {what} while this process had it open; stopping so that nothing more "
                    "is written to a file nobody will read (results already on disk stay in their run folders)")


def _tune_sqlite(engine: Engine, *, wal: bool, path: Path | None = None,
                 identity: tuple[int, int] | None = None) -> None:
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
        if path is not None:
            check_store_file(path, identity)
        _begin_within_bound(conn)


def bound_waits(engine: Engine, until: float | None) -> None:
    """Transactions that begin from now on wait for a SQLite lock until `until` (time.monotonic()) at most, not
    busy_timeout: a stopping worker's last writes end within its stop grace (issue 31: 123 s to exit while another
    process held the lock, 30 s per write). None: busy_timeout again. SQLite only (PostgreSQL's waits are unchanged)."""
    if until is None:
        _wait_until.pop(str(engine.url), None)
    else:
        _wait_until[str(engine.url)] = until


def _begin_within_bound(conn) -> None:
    """BEGIN, then the transaction's statements wait for a SQLite lock busy_timeout at most, or until the bound_waits
    bound. A BEGIN that takes the write lock waits in slices and re-reads the bound between them, so a bound set while
    it waits ends the wait too (a worker stopped while its job's write waited for another process's lock took 30 s,
    not its 3 s grace): SQLite reads busy_timeout as a statement starts, and sqlite3's interrupt() does not end a busy
    wait. A deferred BEGIN takes no lock."""
    url, statement = str(conn.engine.url), begin_statement(conn)
    if statement == "BEGIN DEFERRED":
        conn.exec_driver_sql(statement)
    else:
        _begin_writing(conn, statement, give_up=time.monotonic() + BUSY_TIMEOUT_MS / 1000)
    bound = _wait_until.get(url)
    _set_busy_ms(conn, BUSY_TIMEOUT_MS if bound is None else _ms_left(bound))


def _begin_writing(conn, statement: str, give_up: float) -> None:
    while True:
        left_ms = _ms_left(min(give_up, _wait_until.get(str(conn.engine.url), give_up)))
        _set_busy_ms(conn, min(left_ms, BUSY_SLICE_MS))
        try:
            conn.exec_driver_sql(statement)
            return
        except OperationalError as e:
            if "database is locked" not in str(e.orig) or left_ms <= BUSY_SLICE_MS:
                raise


def _set_busy_ms(conn, busy_ms: int) -> None:
    """PRAGMA busy_timeout, only when the connection's differs (it is BUSY_TIMEOUT_MS from connect)."""
    info = conn.connection.info
    if info.get("busy_ms", BUSY_TIMEOUT_MS) != busy_ms:
        conn.exec_driver_sql(f"PRAGMA busy_timeout={busy_ms}")
        info["busy_ms"] = busy_ms


def _ms_left(until: float) -> int:
    return max(0, min(BUSY_TIMEOUT_MS, int((until - time.monotonic()) * 1000)))


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
        _identity.clear()
        _wait_until.clear()
