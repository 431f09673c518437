"""The job worker: progress, cancel, stop, failures as results, claim races, readers beside a writer,
and (slow) real runs through backend.launch.launcher with a kill -9 of the worker mid-run. Worker processes
(multiprocess): two never claim the same job, readers never see 'database is locked', real runs through the CLI and
the worker (kill -9, cancel, SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from sqlalchemy.exc import OperationalError

from backend.cli import main
from backend.result import RunResult
from backend.spec import READ_BACK
from backend.worker.service import WORKER_ENV, Worker
from db import queries as q
from db.session import REPO
from tests.helpers.launch import cli_process
from tests.helpers.specs import stored_spec
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


def queued_as_stored(engine, spec_json: str) -> int:
    """A queued row holding the spec JSON an older version stored."""
    from sqlalchemy import update

    from db.models import Experiment

    eid = q.submit_experiment(engine, spec("stand-in"))
    with engine.begin() as c:
        c.execute(update(Experiment).where(Experiment.id == eid).values(spec_json=spec_json))
    return eid


def test_a_queued_spec_this_version_cannot_read_fails_with_the_reason_and_the_worker_goes_on(engine, tmp_path):
    stored = spec("unreadable").model_dump_json()[:-1] + ', "retired_field": 1}'  # a field this version does not have
    bad, good = queued_as_stored(engine, stored), q.submit_experiment(engine, spec("fine"))
    runner = FakeRunner()
    assert Worker(engine, runs_dir=tmp_path, runner=runner).serve(drain=True) == 0
    row = q.get_experiment(engine, bad)
    assert row["status"] == "failed" and row["finished_at"] is not None and row["spec_json"] == stored
    assert row["error"] == ("this run's spec cannot be read by this version: ValidationError: retired_field: Extra "
                            "inputs are not permitted")
    assert q.get_status(engine, good) == "ok" and [c["workdir"].name for c in runner.calls] == [str(good)]


def test_a_queued_spec_this_version_no_longer_runs_is_failed_with_the_reason_and_never_launched(engine, tmp_path):
    old, good = queued_as_stored(engine, stored_spec("ep_allgather_db9cb05")), q.submit_experiment(engine, spec("ok"))
    runner = FakeRunner()
    assert Worker(engine, runs_dir=tmp_path, runner=runner).serve(drain=True) == 0
    row = q.get_experiment(engine, old)
    assert row["status"] == "failed" and row["error"] == row["result"].error
    assert row["error"].startswith("not launched: this version does not run this spec: moe_dispatcher=allgather with "
                                   "ep=2: this engine dispatches by all-to-all only")
    kept = RunResult.model_validate_json((tmp_path / str(old) / "result.json").read_text(), context=READ_BACK)
    assert kept.error == row["error"] and kept.spec.model.moe_dispatcher == "allgather"
    assert [c["workdir"].name for c in runner.calls] == [str(good)] and q.get_status(engine, good) == "ok"


def test_a_runner_that_raises_on_a_spec_today_refuses_keeps_its_error(engine, tmp_path, monkeypatch):
    """Building the failed result must not judge the spec again (it raised inside the except handler, killing the
    worker and losing the runner's error)."""
    from backend.worker import job

    monkeypatch.setattr(job, "spec_refusal", lambda s: None, raising=False)  # a rule the pre-launch check misses
    eid = queued_as_stored(engine, stored_spec("ep_allgather_db9cb05"))
    runner = FakeRunner(raises=RuntimeError("rank 1: SpecError: moe_dispatcher=allgather with ep=2"))
    assert Worker(engine, runs_dir=tmp_path, runner=runner).serve(once=True) == 0
    row = q.get_experiment(engine, eid)
    assert row["status"] == "failed" and row["error"] == ("the runner raised RuntimeError: rank 1: SpecError: "
                                                          "moe_dispatcher=allgather with ep=2")
    assert "Traceback" in row["traceback"] and row["result"].spec.model.moe_dispatcher == "allgather"


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


# ---- in processes of their own ----------------------------------------------------------------------------

PY = sys.executable


CLAIMER = """
import sys, time, pathlib
from db.session import open_db
from db import queries as q
engine = open_db({url!r})
go = pathlib.Path({go!r})
while not go.exists():
    time.sleep(0.005)
got = []
while (eid := q.claim_next(engine, sys.argv[1])) is not None:
    got.append(eid)
print(" ".join(map(str, got)))
"""


@pytest.mark.multiprocess
@pytest.mark.serial
def test_two_processes_never_claim_the_same_job(engine, tmp_path):
    url = engine.url.render_as_string(hide_password=False)
    ids = q.submit_experiments(engine, [spec(str(i)) for i in range(30)])
    go = tmp_path / "go"
    script = CLAIMER.format(url=url, go=str(go))
    procs = [subprocess.Popen([PY, "-c", script, f"w{i}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for i in range(2)]
    time.sleep(2.0)  # both import and open the database, then start together
    go.touch()
    claimed = [set(map(int, p.communicate(timeout=120)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert claimed[0].isdisjoint(claimed[1]) and claimed[0] | claimed[1] == set(ids)
    rows = {r["id"]: r for r in q.list_experiments(engine)}
    for i, got in enumerate(claimed):
        assert all(rows[e]["worker_id"] == f"w{i}" and rows[e]["status"] == "running" for e in got)


WRITER = """
from db.session import open_db
from db import queries as q
from tests.helpers.store_helpers import spec, fake_result
engine = open_db({url!r})
for i in range({n}):
    eid = q.submit_experiment(engine, spec(str(i)))
    q.claim_next(engine, "w")
    for step in range(5):
        q.update_progress(engine, eid, step, 5, "timed")
    q.store_result(engine, eid, fake_result(spec(str(i)), seed=i))
print("done")
"""


@pytest.mark.multiprocess
@pytest.mark.serial
def test_readers_never_see_database_is_locked_while_the_worker_writes(engine, tmp_path):
    n = 30
    script = WRITER.format(url=engine.url.render_as_string(hide_password=False), n=n)
    proc = subprocess.Popen([PY, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reads, errors = 0, []
    while proc.poll() is None:
        try:
            rows = q.list_experiments(engine)
            if rows:
                q.get_experiment(engine, rows[0]["id"])
            q.count_experiments(engine, status="ok")
            reads += 1
        except OperationalError as e:
            errors.append(str(e))
    out, err = proc.communicate()
    assert proc.returncode == 0 and out.strip() == "done", err
    assert errors == [] and reads > 0
    assert q.count_experiments(engine, status="ok") == n


TINY_FLAGS = ["--world", "2", "--strategy", "ddp", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16",
              "--vocab", "64", "--global-batch", "4", "--micro-batch", "2", "--steps", "2", "--warmup-steps", "1"]


def start_worker(url: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "1",
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def job_processes(worker_id_prefix: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if (p.environ().get(WORKER_ENV) or "").startswith(worker_id_prefix) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def ranks_started(worker: subprocess.Popen) -> list[psutil.Process]:
    """The worker's job processes once torchrun and both ranks run (empty list until then)."""
    procs = job_processes(f"{os.uname().nodename}:{worker.pid}:")
    ranks = [p for p in procs
             if "backend.engine.rank" in " ".join(_cmdline(p)) and "torch.distributed.run" not in " ".join(_cmdline(p))]
    return procs if len(ranks) >= 2 else []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_submit_then_worker_once_stores_a_real_run(store_urls, tmp_path, capsys):
    url = store_urls.url("e2e.db")
    assert main(["submit", "--db", url, *TINY_FLAGS, "--tag", "e2e", "--name", "tiny ddp"]) == 0
    eid = int(capsys.readouterr().out)
    run = cli_process("worker", "--db", url, "--once", "--runs-dir", str(tmp_path / "runs"), timeout_s=300)
    assert run.returncode == 0, run.stdout + run.stderr
    engine = store_urls.engine("e2e.db")
    row = q.get_experiment(engine, eid)
    res = row["result"]
    assert row["status"] == "ok", (row["error"], row["log_tail"])
    assert res.status == "ok" and len(res.per_rank) == 2 and res.per_rank[0].measured.params_bytes > 0
    assert row["step_s_median"] == res.step_s_median and row["tokens_per_s"] == res.tokens_per_s
    assert row["peak_bytes_max"] == max(r.measured.peak_bytes for r in res.per_rank)
    assert row["progress_step"] is not None and row["tags"] == ["e2e"]
    assert json.loads((tmp_path / "runs" / str(eid) / "result.json").read_text())["status"] == "ok"
    assert main(["show", str(eid), "--db", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["result"]["per_rank"][1]["comm"]["all_reduce"]["bytes"] == res.per_rank[1].comm["all_reduce"].bytes
    assert main(["export", "--db", url, "--format", "csv", "--long"]) == 0
    csv_text = capsys.readouterr().out
    assert csv_text.count("\n") == 3 and str(res.per_rank[1].measured.peak_bytes) in csv_text


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_9_of_the_worker_mid_run_then_restart_interrupts_and_requeues(store_urls, tmp_path):
    url = store_urls.url("kill.db")
    engine = store_urls.engine("kill.db")
    eid = q.submit_experiment(engine, spec("hangs"))
    # Rank 0 hangs at its second step, so the job is reliably mid-run when the worker dies.
    worker = start_worker(url, "--once", env={"SHARDLAB_FAULT": "hang:rank=0:step=1"})
    try:
        jobs = wait_for(lambda: ranks_started(worker), timeout_s=120, every_s=0.2)
        wait_for(lambda: q.get_experiment(engine, eid)["progress_step"] is not None, timeout_s=120, every_s=0.2)
        os.kill(worker.pid, signal.SIGKILL)  # once the run's log holds something: a progress line
        worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert q.get_status(engine, eid) == "running"  # nobody has noticed yet
    restart = start_worker(url, "--once")
    out, _ = restart.communicate(timeout=60)
    assert restart.returncode == 0, out
    row = q.get_experiment(engine, eid)
    assert row["status"] == "interrupted" and "worker process died" in row["error"], out
    assert "SHARDLAB_PROGRESS" in (row["log_tail"] or ""), "the run folder's log tail is stored with the interruption"
    gone, alive = psutil.wait_procs(jobs, timeout=10)
    assert alive == [], f"orphaned job processes survived: {alive}"
    assert q.count_experiments(engine) == 1 and row["spec"] == spec("hangs")
    new = q.requeue_experiment(engine, eid)
    assert q.get_status(engine, new) == "queued" and q.get_experiment(engine, new)["requeue_of"] == eid


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cancel_and_sigterm_of_a_real_running_job(store_urls, tmp_path):
    url = store_urls.url("cancel.db")
    engine = store_urls.engine("cancel.db")
    eid = q.submit_experiment(engine, spec("to cancel"))
    worker = start_worker(url, env={"SHARDLAB_FAULT": "hang:rank=0:step=1"})
    try:
        wait_for(lambda: ranks_started(worker), timeout_s=120, every_s=0.2)
        assert q.cancel_experiment(engine, eid) == "cancelling"
        wait_for(lambda: q.get_status(engine, eid) == "cancelled", timeout_s=60, every_s=0.2)
        assert job_processes(f"{os.uname().nodename}:{worker.pid}:") == []
        again = q.requeue_experiment(engine, eid)
        wait_for(lambda: ranks_started(worker), timeout_s=120, every_s=0.2)
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, out
    row = q.get_experiment(engine, again)
    assert row["status"] == "interrupted" and row["error"].startswith("worker stopped"), out
    assert row["result"] is not None and row["result"].spec == spec("to cancel")
    assert q.worker_heartbeats(engine)[0]["state"] == "stopped"
