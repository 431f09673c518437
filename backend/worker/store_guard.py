"""Riding out store outages: which store errors pass (retry with backoff) and which do not.

A PostgreSQL restart, a SQLite lock held past busy_timeout, a full or read-only disk under the SQLite file: each
surfaces as an OperationalError / InterfaceError / pool timeout that goes away by itself, so the worker keeps
retrying, with exponential backoff and one log line per failure ("store unavailable ... retrying in 4 s").
A store file that vanished (db.session.StoreGone / StoreMissing) or a URL that cannot work is a configuration
error: it is raised at once, and the worker stops with a non-zero exit; so is a schema this code cannot use (a failed
upgrade, db.errors.SchemaError, exit 2), although SQLite reports "duplicate column name" as an OperationalError
too (db.errors.is_outage tells them apart by SQLite's result code / PostgreSQL's SQLSTATE). Anything else (a value
the database refuses) is permanent for that write and is raised too, for the caller to record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from db.errors import is_outage

log = logging.getLogger("shardlab.store")
T = TypeVar("T")
FIRST_WAIT_S = 0.5
MAX_WAIT_S = 30.0


def is_transient(error: BaseException) -> bool:
    """An outage that ends by itself (connection refused or lost, locked, disk I/O or full, pool exhausted); a
    schema error SQLite reports as OperationalError ("duplicate column name") is not one (db.errors.is_outage)."""
    return is_outage(error)


def short(error: BaseException) -> str:
    """The first line of a driver error, without SQLAlchemy's statement dump."""
    text = str(getattr(error, "orig", None) or error).strip().splitlines()
    return f"{type(getattr(error, 'orig', None) or error).__name__}: {text[0] if text else ''}"[:300]


class Backoff:
    """Exponential waits (0.5 s doubling to 30 s), reset after a success."""

    def __init__(self, first_s: float = FIRST_WAIT_S, max_s: float = MAX_WAIT_S):
        self.first_s, self.max_s, self.next_s = first_s, max_s, first_s
        self.failures = 0

    def wait_s(self) -> float:
        wait, self.failures = self.next_s, self.failures + 1
        self.next_s = min(self.max_s, self.next_s * 2)
        return wait

    def reset(self) -> None:
        self.next_s, self.failures = self.first_s, 0


def retry(fn: Callable[[], T], what: str, *, stop: threading.Event | None = None, give_up_after_stop_s: float = 0.0,
          backoff: Backoff | None = None, engine=None, stopped_at: Callable[[], float | None] | None = None) -> T:
    """Call fn until it succeeds, waiting out transient store errors. Permanent errors are raised at once. Once
    `stop` is set, retries go on for at most give_up_after_stop_s more seconds (counted from `stopped_at()`, the
    monotonic time of the stop, when given; else from the first failure seen after it), then the last error is raised.
    With `engine`, its pooled connections are dropped after each failure: a SQLite connection opened while the
    file was read-only stays read-only, and a PostgreSQL connection from before a restart is dead."""
    backoff = backoff or Backoff()
    stop_seen: float | None = None
    while True:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - classified just below
            if not is_transient(e):
                raise
            if engine is not None:
                engine.dispose()
            now = time.monotonic()
            if stop is not None and stop.is_set():
                stop_seen = stop_seen or (stopped_at() if stopped_at is not None else None) or now
                if now - stop_seen >= give_up_after_stop_s:
                    raise
            wait = backoff.wait_s() if stop_seen is None else 1.0
            log.warning("store unavailable while %s (%s); retry %d in %.1f s", what, short(e), backoff.failures, wait)
            if stop is not None and stop_seen is None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            continue
        if backoff.failures:
            log.warning("store reachable again: %s done after %d failed tries", what, backoff.failures)
        backoff.reset()
        return out
