"""The job worker: progress, cancel, stop, failures as results, claim races, readers beside a writer,
and (slow) real runs through backend.launch.launcher with a kill -9 of the worker mid-run."""

from __future__ import annotations

import threading

import pytest

from backend.worker.service import WORKER_ENV, Worker
from db import queries as q
from tests.helpers.store_helpers import fake_result, spec
from tests.helpers.worker_helpers import FakeRunner, wait_for


@pytest.fixture
def engine(store_urls):
    return store_urls.engine()


def _serve(worker: Worker, **kw) -> threading.Thread:
    t = threading.Thread(target=worker.serve, kwargs=kw, daemon=True)
    t.start()
    return t


def test_worker_runs_the_oldest_job_and_stores_progress_and_result(engine, tmp_path):
    first, second = q.submit_experiment(engine, spec("a")), q.submit_experiment(engine, spec("b"))
    runner = FakeRunner(block=True)
    worker = Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.05, runner=runner)
    t = _serve(worker, once=True)
    row = wait_for(lambda: (r := q.get_experiment(engine, first))["progress_step"] == 1 and r)
    assert (row["status"], row["progress_total"], row["progress_phase"]) == ("running", 3, "timed")
    assert q.worker_heartbeats(engine)[0]["state"] == "running"
    runner.release.set()
    t.join(10)
    assert q.get_status(engine, first) == "ok" and q.get_status(engine, second) == "queued"  # --once: one job
    assert runner.calls[0]["workdir"] == tmp_path / "runs" / str(first)
    assert runner.calls[0]["extra_env"][WORKER_ENV] == worker.slot_id(0)
    assert q.get_experiment(engine, first)["result"] == fake_result(spec("a"))
    assert q.worker_heartbeats(engine)[0]["state"] == "stopped"


def test_a_runner_crash_is_stored_as_a_failed_result(engine, tmp_path):
    eid = q.submit_experiment(engine, spec())
    Worker(engine, runs_dir=tmp_path, runner=FakeRunner(raises=OSError("no space left"))).serve(once=True)
    row = q.get_experiment(engine, eid)
    assert row["status"] == "failed" and "OSError: no space left" in row["error"]
    assert "Traceback" in row["traceback"] and row["result"].spec == spec()


def test_cancel_of_a_running_job_reaches_the_runner(engine, tmp_path):
    eid = q.submit_experiment(engine, spec())
    t = _serve(Worker(engine, runs_dir=tmp_path, poll_s=0.05, runner=FakeRunner(block=True)), once=True)
    wait_for(lambda: q.get_status(engine, eid) == "running")
    assert q.cancel_experiment(engine, eid) == "cancelling"
    t.join(10)
    assert not t.is_alive() and q.get_status(engine, eid) == "cancelled"


def test_stop_interrupts_the_running_job_so_it_can_be_requeued(engine, tmp_path):
    eid = q.submit_experiment(engine, spec())
    worker = Worker(engine, runs_dir=tmp_path, poll_s=0.05, runner=FakeRunner(block=True))
    t = _serve(worker)
    wait_for(lambda: q.get_status(engine, eid) == "running")
    worker.stop()  # what SIGTERM does
    t.join(10)
    row = q.get_experiment(engine, eid)
    assert row["status"] == "interrupted" and row["error"].startswith("worker stopped")
    assert q.get_status(engine, q.requeue_experiment(engine, eid)) == "queued"


def test_a_second_stop_signal_inside_the_first_handler_does_not_deadlock(engine, tmp_path):
    """SIGTERM then SIGINT (or two SIGTERMs) can run stop() re-entrantly in the main thread, inside the lock."""
    worker = Worker(engine, runs_dir=tmp_path, runner=FakeRunner(block=True))
    cancel = threading.Event()
    worker._cancels[1] = cancel

    def first_handler_interrupted() -> None:
        with worker._lock:  # the first handler is inside stop() when the second signal's handler runs
            worker.stop()

    t = threading.Thread(target=first_handler_interrupted, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and worker.stopping.is_set() and cancel.is_set()


def test_drain_runs_every_queued_job_once(engine, tmp_path):
    ids = [q.submit_experiment(engine, spec(str(i))) for i in range(3)]
    q.cancel_experiment(engine, ids[1])
    runner = FakeRunner()
    Worker(engine, runs_dir=tmp_path, runner=runner).serve(drain=True)
    assert [c["workdir"].name for c in runner.calls] == [str(ids[0]), str(ids[2])]
    assert [q.get_status(engine, i) for i in ids] == ["ok", "cancelled", "ok"]


def test_concurrency_runs_jobs_side_by_side(engine, tmp_path):
    ids = [q.submit_experiment(engine, spec(str(i))) for i in range(3)]
    runner = FakeRunner(block=True)
    t = _serve(Worker(engine, runs_dir=tmp_path, poll_s=0.05, runner=runner), drain=True, concurrency=2)
    wait_for(lambda: q.count_experiments(engine, status="running") == 2)
    assert q.get_status(engine, ids[2]) == "queued"
    wait_for(lambda: len({w["id"] for w in q.worker_heartbeats(engine) if w["state"] == "running"}) == 2)
    runner.release.set()
    t.join(10)
    assert [q.get_status(engine, i) for i in ids] == ["ok"] * 3
