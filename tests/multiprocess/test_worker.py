"""Worker processes: two never claim the same job, readers never see 'database is locked', and real runs through the CLI and the worker (kill -9, cancel, SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from sqlalchemy.exc import OperationalError

from backend.cli import main
from backend.worker.service import WORKER_ENV
from db import queries as q
from db.session import REPO
from tests.helpers.store_helpers import spec
from tests.helpers.worker_helpers import wait_for

PY = sys.executable


@pytest.fixture
def engine(store_urls):
    return store_urls.engine()


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


@pytest.mark.serial
def test_two_processes_never_claim_the_same_job(engine, tmp_path):
    url = engine.url.render_as_string(hide_password=False)
    ids = q.submit_experiments(engine, [spec(str(i)) for i in range(30)])
    go = tmp_path / "go"
    script = CLAIMER.format(url=url, go=str(go))
    procs = [subprocess.Popen([PY, "-c", script, f"w{i}"], cwd=REPO, stdout=subprocess.PIPE, text=True) for i in range(2)]
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


# ---- real runs (backend.launch.launcher + the engine) ------------------------------------------

TINY_FLAGS = ["--world", "2", "--strategy", "ddp", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16",
              "--vocab", "64", "--global-batch", "4", "--micro-batch", "2", "--steps", "2", "--warmup-steps", "1"]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "backend", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def start_worker(url: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "1", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
    ranks = [p for p in procs if "backend.engine.rank" in " ".join(_cmdline(p)) and "torch.distributed.run" not in " ".join(_cmdline(p))]
    return procs if len(ranks) >= 2 else []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow
def test_submit_then_worker_once_stores_a_real_run(store_urls, tmp_path, capsys):
    url = store_urls.url("e2e.db")
    assert main(["submit", "--db", url, *TINY_FLAGS, "--tag", "e2e", "--name", "tiny ddp"]) == 0
    eid = int(capsys.readouterr().out)
    run = cli("worker", "--db", url, "--once", "--runs-dir", str(tmp_path / "runs"))
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


@pytest.mark.slow
def test_kill_9_of_the_worker_mid_run_then_restart_interrupts_and_requeues(store_urls, tmp_path):
    url = store_urls.url("kill.db")
    engine = store_urls.engine("kill.db")
    eid = q.submit_experiment(engine, spec("hangs"))
    # Rank 0 hangs at its second step, so the job is reliably mid-run when the worker dies.
    worker = start_worker(url, "--once", env={"SHARDLAB_FAULT": "hang:rank=0:step=1"})
    try:
        jobs = wait_for(lambda: ranks_started(worker), timeout_s=120, every_s=0.2)
        os.kill(worker.pid, signal.SIGKILL)
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
    gone, alive = psutil.wait_procs(jobs, timeout=10)
    assert alive == [], f"orphaned job processes survived: {alive}"
    assert q.count_experiments(engine) == 1 and row["spec"] == spec("hangs")
    new = q.requeue_experiment(engine, eid)
    assert q.get_status(engine, new) == "queued" and q.get_experiment(engine, new)["requeue_of"] == eid


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
