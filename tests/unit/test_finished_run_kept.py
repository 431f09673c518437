"""Issue 31 items 6 and 9a: a finished run is never thrown away because its result.json cannot be written (a full
runs folder right after the ranks finish: stored from memory, or kept in memory and retried while the store is on
that full disk too), and a worker stopped while another process holds the SQLite lock exits within its stop grace."""

from __future__ import annotations

import errno
import json
import sqlite3
import threading
import time

import pytest

from backend.launch import launcher
from backend.worker.service import Worker
from db import queries as q
from db.session import forget_engines, open_db
from tests.helpers.store_helpers import SmallFs, fake_result, spec
from tests.helpers.worker_helpers import FakeRunner, wait_for


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFs(tmp_path / "small", "8m")
    reason = fs.mount()
    if reason:
        pytest.skip(reason)
    yield fs
    forget_engines()
    fs.unmount()


def finishing_then(disk_full):
    """launcher._run_job standing in for the ranks: they finish with a result, then the disk fills up."""
    def run_job(s, workdir, *_args):
        disk_full()
        return fake_result(s)
    return run_job


def serve(worker: Worker, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("code", worker.serve(**kw)), daemon=True)
    t.start()
    return t, out


def test_the_launcher_returns_a_finished_result_it_could_not_write(tmp_path, monkeypatch):
    real = launcher.write_atomic

    def full(path, text):
        if path.name == "result.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(launcher, "write_atomic", full)
    monkeypatch.setattr(launcher, "_run_job", finishing_then(lambda: None))
    result = launcher.run_experiment(spec("finished"), workdir=tmp_path / "run")
    assert result.status == "ok" and result.per_rank and not (tmp_path / "run" / "result.json").exists()


def test_a_full_runs_folder_after_the_ranks_finish_stores_the_result_from_memory(small_fs, tmp_path, monkeypatch,
                                                                                 caplog):
    monkeypatch.setattr(launcher, "_run_job", finishing_then(small_fs.fill))
    calls = []

    def run(s, **kw):
        calls.append(kw["workdir"])
        return launcher.run_experiment(s, **kw)

    engine = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    eid = q.submit_experiment(engine, spec("finished"))
    worker = Worker(engine, runs_dir=small_fs.path / "runs", poll_s=0.05, runner=run, min_free_bytes=0)
    t, out = serve(worker, once=True)
    t.join(60)
    assert not t.is_alive() and out["code"] == 0
    assert len(calls) == 1, "the finished run was launched again"
    assert "put back in the queue" not in caplog.text and "storing from memory" in caplog.text
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok" and row["result"].per_rank == fake_result(spec("finished")).per_rank


@pytest.mark.slow
def test_with_the_store_on_the_full_disk_too_the_result_waits_in_memory_and_is_stored_later(small_fs, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr(launcher, "_run_job", finishing_then(small_fs.fill))
    calls = []

    def run(s, **kw):
        calls.append(kw["workdir"])
        return launcher.run_experiment(s, **kw)

    engine = open_db(f"sqlite:///{small_fs.path / 'store.db'}")
    eid = q.submit_experiment(engine, spec("finished"))
    worker = Worker(engine, runs_dir=small_fs.path / "runs", poll_s=0.05, heartbeat_s=0.2, runner=run,
                    min_free_bytes=0)
    worker.max_backoff_s = 1.0
    t, out = serve(worker, once=True)
    wait_for(lambda: calls, timeout_s=30)
    time.sleep(4)
    assert t.is_alive(), "the worker gave up on a result it holds"
    small_fs.free()
    t.join(60)
    assert not t.is_alive() and out["code"] == 0 and len(calls) == 1
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok" and row["result"].per_rank == fake_result(spec("finished")).per_rank
    on_disk = json.loads((small_fs.path / "runs" / str(eid) / "result.json").read_text())
    assert on_disk["status"] == "ok"  # written once space came back, as the next worker would need it


@pytest.mark.heavy
def test_a_write_already_waiting_for_the_lock_gives_up_at_a_bound_set_while_it_waits(tmp_path):
    """The race behind a 30 s stop: a job's write began (busy_timeout 30 s) just before the worker's stop bounded the
    waits; that write must end at the bound too."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from db.session import bound_waits, writer

    engine = open_db(f"sqlite:///{tmp_path / 'locked.db'}")
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    outcome: dict[str, object] = {}

    def write() -> None:
        t0 = time.monotonic()
        try:
            with writer(engine) as s, s.begin():
                s.execute(text("SELECT 1"))
            outcome["error"] = None
        except OperationalError as e:
            outcome["error"] = str(e.orig)
        outcome["took_s"] = time.monotonic() - t0

    t = threading.Thread(target=write, daemon=True)
    try:
        t.start()
        time.sleep(1.0)  # its BEGIN IMMEDIATE waits for the holder now
        bound_waits(engine, time.monotonic() + 1.0)
        t.join(20)
    finally:
        bound_waits(engine, None)
        holder.execute("ROLLBACK")
        holder.close()
    assert not t.is_alive() and outcome["error"] == "database is locked", outcome
    assert outcome["took_s"] < 4.0, outcome


@pytest.mark.heavy
def test_a_worker_stopped_while_another_process_holds_the_lock_exits_within_its_grace(tmp_path):
    path = tmp_path / "locked.db"
    engine = open_db(f"sqlite:///{path}")
    eid = q.submit_experiment(engine, spec("locked out"))
    runner = FakeRunner(block=True)
    worker = Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.05, heartbeat_s=0.2, runner=runner)
    worker.stop_grace_s = 3.0
    t, out = serve(worker)
    wait_for(lambda: runner.calls)  # the job runs (a stop before the runner starts waits for it to start and end)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.monotonic()
        worker.stop()
        t.join(90)
        took = time.monotonic() - t0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not t.is_alive() and took < worker.stop_grace_s + 5, f"{took:.1f} s to stop"  # main: still alive at 90 s
    kept = json.loads((tmp_path / "runs" / str(eid) / "result.json").read_text())
    assert kept["status"] == "interrupted"  # the next worker imports it
    assert q.get_status(engine, eid) == "running"
