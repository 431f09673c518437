"""The store's errors: StoreError (a store that cannot be used as it is: exit 2, never retried) and `is_outage`, which
tells an outage (it ends by itself: retry) from an error that fails the same way on every try."""

from __future__ import annotations

from sqlalchemy import exc as sa_exc


class StoreError(RuntimeError):
    """The configured store cannot be used as it is; the message says what happened and what to do."""


class SchemaError(StoreError):
    """The store's schema cannot be brought to this version's (db.migrations.upgrade): not an outage, nothing retries
    it; the message names the store's revision and the one that failed."""


SQLITE_OUTAGES = {5: "BUSY", 6: "LOCKED", 7: "NOMEM", 8: "READONLY", 9: "INTERRUPT", 10: "IOERR", 13: "FULL",
                  14: "CANTOPEN", 15: "PROTOCOL"}
"""SQLite primary result codes of faults that end by themselves (a lock, a full or read-only disk). Everything else
SQLite raises as OperationalError too, SQLITE_ERROR above all ("no such column", "duplicate column name"): a
schema or a statement that will fail the same way on every try."""
PG_OUTAGE_SQLSTATES = ("08", "40", "53", "55P03", "57", "58")
"""PostgreSQL SQLSTATE classes of outages: connection, rollback (serialization, deadlock), insufficient resources,
lock not available, operator intervention (shutdown, restart), system error."""


def is_outage(error: BaseException) -> bool:
    """A store error that goes away by itself (connection refused or lost, locked, disk full or read-only, pool
    exhausted), as opposed to one that fails the same way on every try (a schema the code does not match)."""
    if isinstance(error, StoreError) or not isinstance(error, sa_exc.SQLAlchemyError):
        return False
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    orig = getattr(error, "orig", None)
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in SQLITE_OUTAGES
    state = getattr(orig, "sqlstate", None)
    if state:
        return state.startswith(PG_OUTAGE_SQLSTATES)
    return isinstance(error, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                              sa_exc.DisconnectionError))
