"""How a worker process stops: SIGTERM / SIGINT (`install_signal_handlers`), or, for the worker the dashboard
starts (`worker --exit-with PID`), the process it follows exiting, even by kill -9 (`follow_parent`)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from backend.worker.service import Worker

log = logging.getLogger("shardlab.worker")


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM / SIGINT stop the worker cleanly: its running job is ended and stored `interrupted`."""

    def _handler(signum, _frame) -> None:
        log.warning("signal %s: stopping; the running job is interrupted", signum)
        worker.stop()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def follow_parent(pid: int, stop: Callable[[], None], every_s: float = 1.0) -> threading.Thread:
    """A daemon thread that calls `stop()` once process `pid` is gone (or was never there); a new process that
    reuses the pid does not count (its start time differs)."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None

    def alive() -> bool:
        try:
            p = psutil.Process(pid)
            return started is not None and p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            threading.Event().wait(every_s)
        stop()

    t = threading.Thread(target=watch, name=f"follow-{pid}", daemon=True)
    t.start()
    return t
