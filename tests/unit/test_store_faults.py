"""Issue 21 items 1-5 with real faults: ids never reused and run folders bound to their run; results that reach
the disk are stored however long the store is away (a real PostgreSQL server stopped and started, a full
tmpfs under the SQLite file) or by the next worker; workers ride out outages (a PostgreSQL restart, a SQLite
lock past busy_timeout, an immutable file); a removed or replaced SQLite file stops the worker (exit 2) and is
never silently re-created; live workers recover dead workers' jobs while they poll. Met by a worker process
(multiprocess): an immutable store file is waited out; a removed or replaced one stops it and is not re-created."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from backend.cli import main
from backend.spec import ExperimentSpec
from backend.worker.service import Worker
from db import queries as q
from db.session import REPO, forget_engines, open_db
from tests.helpers.store_helpers import TINY, SmallFs, fake_result, spec
from tests.helpers.worker_helpers import FakeRunner, wait_for

PY = sys.executable


def _serve(worker: Worker, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("code", worker.serve(**kw)), daemon=True)
    t.start()
    return t, out


def fresh_heartbeat(engine, max_age_s: float = 2.0) -> bool:
    try:
        return any(w["age_s"] < max_age_s and w["state"] == "idle" for w in q.worker_heartbeats(engine))
    except Exception:  # noqa: BLE001 - the store may be down while we look
        return False


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFs(tmp_path / "small", "8m")
    reason = fs.mount()
    if reason:
        pytest.skip(reason)
    yield fs
    forget_engines()
    fs.unmount()


# ---- 1. ids never reused, folders bound to their run -------------------------------------------

def stamp(folder: Path, experiment_id: int, run_uid: str) -> Path:
    """What the worker writes into a run folder it starts a run in (backend/run_folders.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({"experiment_id": experiment_id, "run_uid": run_uid}))
    return folder


def test_ids_are_never_reused_after_deleting_the_newest_run(store_urls):
    engine = store_urls.engine()
    first, second = q.submit_experiments(engine, [spec("a"), spec("b")])
    q.delete_experiment(engine, second)
    assert q.submit_experiment(engine, spec("c")) > second


def test_every_run_has_its_own_uid(store_urls):
    engine = store_urls.engine()
    ids = q.submit_experiments(engine, [spec("a"), spec("b")])
    ids.append(q.submit_experiment(engine, spec("a")))
    uids = q.run_uids(engine)
    assert sorted(uids) == ids and len(set(uids.values())) == 3 and all(len(u) == 32 for u in uids.values())
    assert q.get_experiment(engine, ids[1])["run_uid"] == uids[ids[1]]


def test_delete_removes_only_the_folder_bound_to_that_run(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = open_db(url)
    mine, other = q.submit_experiments(engine, [spec("mine"), spec("other")])
    runs = tmp_path / "runs"
    stamp(runs / str(mine), mine, q.get_experiment(engine, mine)["run_uid"])
    stamp(runs / str(other), other, "another store's run uid")
    assert main(["delete", str(mine), "--db", url]) == 0 and main(["delete", str(other), "--db", url]) == 0
    assert "removed its run folder" in capsys.readouterr().out
    assert not (runs / str(mine)).exists() and (runs / str(other) / "run.json").exists()


def test_the_dashboards_delete_removes_the_run_folder_too(tmp_path, monkeypatch):
    from dashboard import store_access

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    engine = open_db(url)
    mine, other = q.submit_experiments(engine, [spec("mine"), spec("other")])
    runs = tmp_path / "runs"  # the worker's default: beside the SQLite file
    stamp(runs / str(mine), mine, q.get_experiment(engine, mine)["run_uid"])
    stamp(runs / str(other), other, "another store's run uid")
    assert store_access.delete([mine, other]) == []
    assert q.get_experiment(engine, mine) is None and q.get_experiment(engine, other) is None
    assert not (runs / str(mine)).exists() and (runs / str(other) / "run.json").exists()


def test_a_fresh_slurm_run_sets_another_runs_folder_aside_and_submits(tmp_path, monkeypatch):
    from backend.cluster import runner, slurm
    from backend.cluster.slurm_config import SlurmConfig
    from tests.helpers.worker_helpers import slurm_spec

    old = tmp_path / "runs" / "1"
    old.mkdir(parents=True)
    (old / "slurm.json").write_text(json.dumps({"job_id": "7", "run_uid": "old-run"}))
    (old / "ranks.json").write_text("{}")
    submitted = []
    monkeypatch.setattr(slurm, "submit", lambda script, env=None: submitted.append(script) or "8")
    monkeypatch.setattr(slurm, "query", lambda job_id: slurm.JobState("FAILED", "NonZeroExitCode", exit_code="1:0"))
    cfg = SlurmConfig(run_dir=tmp_path / "runs")
    res = runner.run_on_slurm(slurm_spec(), workdir=Path("1"), config=cfg, run_uid="new-run")
    assert submitted and res.env["launch"]["job_id"] == "8" and res.env["launch"]["reattached"] is False
    assert json.loads((old / "slurm.json").read_text())["run_uid"] == "new-run" and not (old / "ranks.json").exists()
    (aside,) = (tmp_path / "runs").glob("1.stale-*")
    assert json.loads((aside / "slurm.json").read_text())["job_id"] == "7"  # kept, not deleted
    # an adopted run re-attaches only to its own job
    res = runner.run_on_slurm(slurm_spec(), workdir=Path("1"), config=cfg, run_uid="third-run", adopt=True)
    assert res.status == "failed" and "belongs to another run" in res.error and len(submitted) == 1


# ---- 2. a result on disk is the source of truth until it is stored ---------------------------------

def quick(worker: Worker) -> Worker:
    worker.max_backoff_s = 1.0  # retry every second at most: the test does not wait out a 30 s backoff
    return worker


def claimed_by_a_dead_worker(engine, ids: list[int]) -> None:
    """The runs are running, claimed by a worker of this host whose process is gone (killed with kill -9)."""
    dead = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(dead.pid).create_time()
    dead.kill()
    dead.wait()
    host = socket.gethostname()
    q.register_worker(engine, f"{host}:{dead.pid}:0", pid=dead.pid, host=host, pid_started=started)
    for eid in ids:
        assert q.claim_next(engine, f"{host}:{dead.pid}:0", host=host) == eid


def test_a_result_left_on_disk_is_imported_before_anything_is_marked_interrupted(store_urls, tmp_path):
    engine = store_urls.engine()
    done, lost = q.submit_experiments(engine, [spec("finished"), spec("lost")])
    claimed_by_a_dead_worker(engine, [done, lost])
    runs = tmp_path / "runs"
    uid = q.get_experiment(engine, done).get("run_uid", "")
    stamp(runs / str(done), done, uid)
    (runs / str(done) / "result.json").write_text(fake_result(spec("finished"), seed=3).to_json())
    stamp(runs / str(lost), lost, "not this run")  # a result that belongs to another run is never imported
    (runs / str(lost) / "result.json").write_text(fake_result(spec("lost")).to_json())
    Worker(engine, runs_dir=runs, runner=FakeRunner()).serve(once=True)
    row = q.get_experiment(engine, done)
    assert row["status"] == "ok" and row["result"] == fake_result(spec("finished"), seed=3)
    row = q.get_experiment(engine, lost)
    assert row["status"] == "interrupted" and "worker process died" in row["error"]


@pytest.mark.slow
def test_a_full_disk_under_the_sqlite_file_delays_the_result_instead_of_dropping_it(small_fs, tmp_path):
    url = f"sqlite:///{small_fs.path / 'store.db'}"
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("disk full"))
    runner = FakeRunner(block=True)
    worker = quick(Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.1, heartbeat_s=0.5, runner=runner))
    t, out = _serve(worker, once=True)
    wait_for(lambda: q.get_status(engine, eid) == "running")
    wait_for(runner.started.is_set)  # "running" is stored at the claim, before the worker has read the spec
    small_fs.fill()
    try:
        runner.release.set()
        time.sleep(9.5)
        assert t.is_alive() and q.get_status(engine, eid) == "running"
    finally:
        small_fs.free()
    t.join(60)
    assert not t.is_alive() and out["code"] == 0
    assert q.get_experiment(engine, eid)["result"] == fake_result(spec("disk full"))


@pytest.mark.heavy
def test_a_sqlite_lock_held_past_busy_timeout_is_ridden_out(tmp_path, monkeypatch):
    from db import session

    monkeypatch.setattr(session, "BUSY_TIMEOUT_MS", 300)  # the same fault as a 45 s lock, scaled to the test
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    engine = open_db(url)
    worker = quick(Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.05, runner=FakeRunner()))
    t, out = _serve(worker)
    wait_for(lambda: fresh_heartbeat(engine))
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    time.sleep(3)
    holder.execute("ROLLBACK")
    holder.close()
    eid = q.submit_experiment(engine, spec("after the lock"))
    wait_for(lambda: q.get_status(engine, eid) == "ok", timeout_s=30)
    assert t.is_alive()
    worker.stop()
    t.join(10)
    assert out["code"] == 0


# ---- 5. live workers recover dead workers' jobs as they poll -----------------------------------------

def running_row(engine, s, worker_id: str) -> int:
    """A run already claimed by `worker_id` (inserted running: a polling worker must not claim it first)."""
    from db import result_rows as rr
    from db.models import Experiment, utcnow
    from db.session import writer

    with writer(engine) as session, session.begin():
        exp = Experiment(**rr.spec_columns(s), status="running", worker_id=worker_id, started_at=utcnow(),
                         heartbeat_at=utcnow(), cancel_requested=False, created_at=utcnow())
        session.add(exp)
        session.flush()
        return exp.id


def test_a_refusal_left_on_disk_is_imported_though_todays_rules_refuse_its_spec(store_urls, tmp_path):
    """A dead worker's result.json is read back as stored: the refusal of a spec an older version queued (ep with the
    allgather dispatcher, db9cb05) is imported with its reason, not set aside as unreadable and lost."""
    from sqlalchemy import update

    from backend.result import RunResult, Status
    from backend.spec import READ_BACK
    from db.models import Experiment
    from tests.helpers.specs import stored_spec

    engine = store_urls.engine()
    eid = q.submit_experiment(engine, spec("stand-in"))
    with engine.begin() as c:
        c.execute(update(Experiment).where(Experiment.id == eid).values(spec_json=stored_spec("ep_allgather_db9cb05")))
    claimed_by_a_dead_worker(engine, [eid])
    old = ExperimentSpec.model_validate_json(stored_spec("ep_allgather_db9cb05"), context=READ_BACK)
    refusal = RunResult.of_spec(old, status=Status.FAILED, error="not launched: this version does not run this spec")
    folder = stamp(tmp_path / "runs" / str(eid), eid, q.get_experiment(engine, eid)["run_uid"])
    (folder / "result.json").write_text(refusal.to_json())
    Worker(engine, runs_dir=tmp_path / "runs", runner=FakeRunner()).recover()
    row = q.get_experiment(engine, eid)
    assert (row["status"], row["error"]) == ("failed", refusal.error) and row["result"].spec == old


def test_an_interrupted_run_keeps_its_log_tail_and_its_ranks_error(store_urls, tmp_path):
    """A worker killed with kill -9 (or one that crashed) leaves log.txt and rank-N.error.json in the run folder: the
    run is interrupted with them, as a stopped worker stores its job's log tail; a heartbeat gone stale alike."""
    from datetime import timedelta

    from sqlalchemy import update

    from backend.runtime.protocol import RankError, write_rank_error
    from backend.worker import recovery
    from db.models import Experiment, utcnow

    engine = store_urls.engine()
    killed, silent = q.submit_experiments(engine, [spec("killed"), spec("silent")])
    claimed_by_a_dead_worker(engine, [killed])
    q.register_worker(engine, "elsewhere:1:0", pid=1, host="elsewhere", pid_started=None)
    assert q.claim_next(engine, "elsewhere:1:0", host="elsewhere") == silent
    runs = tmp_path / "runs"
    for eid in (killed, silent):
        folder = stamp(runs / str(eid), eid, q.get_experiment(engine, eid)["run_uid"])
        (folder / "log.txt").write_text("".join(f"[rank{eid}] line {i}\n" for i in range(300)))
    write_rank_error(runs / str(killed), RankError(rank=1, error="RuntimeError: boom", traceback="Traceback: here"))
    with engine.begin() as c:  # the silent run's worker, on another host, stopped beating an hour ago
        c.execute(update(Experiment).where(Experiment.id == silent).values(heartbeat_at=utcnow() - timedelta(hours=1)))
    assert sorted(recovery.recover(engine, runs, socket.gethostname(), stale_after_s=60)) == [killed, silent]
    row = q.get_experiment(engine, killed)
    assert row["status"] == "interrupted" and row["error"] == ("the worker process died while the job was running "
                                                               "(killed or crashed); first rank error on record: "
                                                               "rank 1: RuntimeError: boom")
    assert (row["failing_rank"], row["traceback"]) == (1, "Traceback: here")
    assert row["log_tail"].splitlines() == [f"[rank{killed}] line {i}" for i in range(100, 300)]
    row = q.get_experiment(engine, silent)
    assert row["error"].startswith("no heartbeat for more than 60 s") and row["failing_rank"] is None
    assert row["log_tail"].splitlines()[-1] == f"[rank{silent}] line 299"


@pytest.mark.heavy
def test_a_live_worker_recovers_dead_and_stale_jobs_while_it_polls(store_urls, tmp_path):
    engine = store_urls.engine()
    worker = Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.05, heartbeat_s=0.2, stale_after_s=2.0,
                    runner=FakeRunner())
    worker.recover_every_s = 0.5
    t, out = _serve(worker)
    wait_for(lambda: fresh_heartbeat(engine))  # start-up recovery is over: what follows happens while it polls
    q.register_worker(engine, "elsewhere:1:0", pid=1, host="elsewhere", pid_started=None)
    far = running_row(engine, spec("other host"), "elsewhere:1:0")
    dead = subprocess.Popen(["sleep", "60"])
    host = socket.gethostname()
    q.register_worker(engine, f"{host}:{dead.pid}:0", pid=dead.pid, host=host,
                      pid_started=psutil.Process(dead.pid).create_time())
    near = running_row(engine, spec("this host"), f"{host}:{dead.pid}:0")
    t0 = time.monotonic()
    dead.kill()
    dead.wait()
    wait_for(lambda: q.get_status(engine, near) == "interrupted", timeout_s=10)
    assert "worker process died" in q.get_experiment(engine, near)["error"] and time.monotonic() - t0 < 5
    wait_for(lambda: q.get_status(engine, far) == "interrupted", timeout_s=15)  # no heartbeat for > 2 s
    assert "no heartbeat" in q.get_experiment(engine, far)["error"]
    worker.stop()
    t.join(10)
    assert out["code"] == 0


FAKE_SBATCH = """#!/bin/bash
# sbatch --parsable SCRIPT: starts the job's ranks right here in the background (one node, standalone torchrun) and
# prints the job id at once, as sbatch does (run inside sbatch, a loaded machine took the job past the client's
# 30 s call timeout); scontrol says RUNNING until the ranks end
script="${@: -1}"
eval "$(grep '^RUN_DIR=' "$script")"
id=$(( $(cat "$FAKE_SLURM/next" 2>/dev/null || echo 0) + 1 )); echo "$id" > "$FAKE_SLURM/next"
echo RUNNING > "$FAKE_SLURM/$id"
(cd "$FAKE_SLURM_REPO" && "$FAKE_SLURM_PY" -m torch.distributed.run --standalone --nproc-per-node 1 \\
    -m backend.engine.rank --spec "$RUN_DIR/spec.json" --out "$RUN_DIR" > "$RUN_DIR/slurm-$id.out" 2>&1
 [ $? = 0 ] && echo COMPLETED > "$FAKE_SLURM/$id" || echo FAILED > "$FAKE_SLURM/$id") </dev/null >/dev/null 2>&1 &
echo "$id"
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol show job -o ID
id="${@: -1}"
[ -f "$FAKE_SLURM/$id" ] || { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }
echo "JobId=$id JobState=$(cat "$FAKE_SLURM/$id") Reason=None NodeList=node1 ExitCode=0:0"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """sbatch / squeue / scontrol / sacct on PATH that run a job on this machine and remember its state."""
    bin_dir, state = tmp_path / "fake-bin", tmp_path / "fake-slurm"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL), ("squeue", "#!/bin/bash\nexit 0\n"),
                       ("sacct", "#!/bin/bash\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    cfg = tmp_path / "shardlab.toml"
    cfg.write_text(f'[slurm]\nrun_dir = "{tmp_path / "cluster-runs"}"\n')
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM": str(state),
            "FAKE_SLURM_REPO": str(REPO),
            "FAKE_SLURM_PY": PY, "SHARDLAB_CLUSTER_CONFIG": str(cfg), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_a_new_slurm_run_never_stores_an_old_runs_measurements(fake_slurm, tmp_path, monkeypatch, capsys):
    """The issue's repro: submit OLD, run it, delete it, submit NEW, run it: NEW must be its own run, even when
    the old run's folder is still on disk under NEW's id (a store from before revision 0007, or a UI delete)."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    tiny = ["--executor", "slurm", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
            "--global-batch", "2", "--micro-batch", "2", "--warmup-steps", "0"]
    for key, value in fake_slurm.items():  # the CLI and the worker run in this process, with the fake commands
        monkeypatch.setenv(key, value)

    def cli(*args: str) -> str:
        assert main([*args, "--db", url]) == 0
        return capsys.readouterr().out

    def worker_once() -> None:
        assert Worker(open_db(url), runs_dir=tmp_path / "local-runs", poll_s=0.1).serve(once=True) == 0

    old = int(cli("submit", *tiny, "--name", "OLD", "--seed", "1", "--steps", "3"))
    worker_once()
    old_row = q.get_experiment(open_db(url), old)
    assert old_row["status"] == "ok" and len(old_row["result"].per_rank[0].step_s) == 3, old_row["error"]
    runs = tmp_path / "cluster-runs"
    left_behind = tmp_path / "old-folder"
    shutil.copytree(runs / str(old), left_behind)
    cli("delete", str(old))
    new = int(cli("submit", *tiny, "--name", "NEW", "--seed", "9", "--steps", "2"))
    if not (runs / str(new)).exists():  # ids are not reused any more: put the old folder where a reused id finds it
        shutil.copytree(left_behind, runs / str(new))
    worker_once()
    row = q.get_experiment(open_db(url), new)
    res = row["result"]
    assert row["status"] == "ok", (row["error"], row["log_tail"])
    assert res.spec.name == "NEW" and res.spec.train.seed == 9 and res.env["launch"]["reattached"] is False
    assert len(res.per_rank[0].step_s) == 2 and res.env["launch"]["job_id"] == "2"
    assert list(runs.glob(f"{new}.stale-*")), "the old run's folder was set aside, not followed"


@pytest.mark.heavy
def test_two_writers_storing_the_same_result_follow_each_other(store_urls):
    """A worker storing its result and another importing the same result.json (the soak hit this on PostgreSQL:
    UniqueViolation on experiment_summaries, which then stopped every worker)."""
    engine = store_urls.engine()
    eid = q.submit_experiment(engine, spec("twice"))
    result = fake_result(spec("twice"))
    for _ in range(10):
        go, errors = threading.Barrier(4), []

        def store() -> None:  # run by the threads joined at the end of this iteration
            go.wait()  # noqa: B023
            try:
                q.store_result(engine, eid, result)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)  # noqa: B023 - a thread still running after join(30) reports into the next round

        threads = [threading.Thread(target=store) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
    assert q.get_experiment(engine, eid)["result"] == result


def test_a_live_workers_result_on_disk_is_left_to_it(store_urls, tmp_path):
    engine = store_urls.engine()
    eid = q.submit_experiment(engine, spec("mine to store"))
    me = psutil.Process()
    host = socket.gethostname()
    q.register_worker(engine, f"{host}:{me.pid}:9", pid=me.pid, host=host, pid_started=me.create_time())
    assert q.claim_next(engine, f"{host}:{me.pid}:9", host=host) == eid
    stamp(tmp_path / "runs" / str(eid), eid, q.get_experiment(engine, eid)["run_uid"])
    (tmp_path / "runs" / str(eid) / "result.json").write_text(fake_result(spec("mine to store")).to_json())
    Worker(engine, runs_dir=tmp_path / "runs", runner=FakeRunner()).recover()
    assert q.get_status(engine, eid) == "running"  # its live worker stores it (importing raced with it)


# ---- in processes of their own ----------------------------------------------------------------------------

def start_worker(url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "0.5",
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def stop(proc: subprocess.Popen, timeout: float = 30) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_immutable_store_file_is_waited_out(tmp_path):
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    url = f"sqlite:///{tmp_path / 'frozen.db'}"
    engine = open_db(url)
    # fails in the launcher's preflight (no CUDA here): the worker's run ends at once, no process is started
    eid = q.submit_experiment(engine, ExperimentSpec.model_validate(
        {**TINY, "name": "frozen", "runtime": {"device": "cuda", "backend": "nccl"}}))
    forget_engines()
    db_file = tmp_path / "frozen.db"
    if subprocess.run(["chattr", "+i", str(db_file)], capture_output=True).returncode != 0:
        pytest.skip("this file system does not take the immutable flag")
    lines: list[str] = []
    try:
        proc = start_worker(url, "--once", "--runs-dir", str(tmp_path / "runs"), "--max-backoff-s", "1")
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        # until the worker has met the read-only store (its start-up alone can take seconds on a loaded host), then a
        # few of its 1 s retries more
        wait_for(lambda: any("store unavailable" in line for line in lines) or proc.poll() is not None, timeout_s=120)
        time.sleep(3)
        assert proc.poll() is None, "the worker quit on an immutable store"
    finally:
        subprocess.run(["chattr", "-i", str(db_file)])
    try:
        proc.wait(timeout=120)  # --once: it runs the job once the file is writable, then exits
        reader.join(timeout=30)
    finally:
        out = "".join(lines) if proc.poll() is not None else stop(proc)
    assert proc.returncode == 0 and "store unavailable" in out and "readonly" in out, out[-2000:]
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "failed" and "needs CUDA" in row["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_removed_or_replaced_store_file_stops_the_worker_and_is_not_recreated(tmp_path, capsys, how):
    db_file = tmp_path / "store.db"
    url = f"sqlite:///{db_file}"
    open_db(url)
    forget_engines()
    proc = start_worker(url, "--runs-dir", str(tmp_path / "runs"))
    try:
        wait_for(lambda: fresh_heartbeat(open_db(url)), timeout_s=60)
        forget_engines()
        if how == "removed":
            db_file.unlink()
        else:
            shutil.copy(db_file, tmp_path / "copy.db")
            os.replace(tmp_path / "copy.db", db_file)
        proc.wait(timeout=60)
    finally:
        out = stop(proc)
    assert proc.returncode == 2, out[-3000:]
    assert f"the SQLite store {db_file} {'was removed' if how == 'removed' else 'was replaced'}" in out
    if how == "removed":
        assert main(["list", "--db", url]) == 2
        assert "is gone" in capsys.readouterr().err and not db_file.exists()


# ---- a real PostgreSQL server restarted (e2e) --------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.slow
def test_a_result_finished_during_a_postgres_restart_is_stored_when_it_is_back(pg_server, tmp_path):
    url = pg_server.url(pg_server.new_database())
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("across a restart"))
    runner = FakeRunner(block=True)
    worker = quick(Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.1, heartbeat_s=0.5, runner=runner))
    t, out = _serve(worker, once=True)
    wait_for(lambda: q.get_status(engine, eid) == "running")
    wait_for(runner.started.is_set)  # "running" is stored at the claim, before the worker has read the spec
    pg_server.pause()
    try:
        runner.release.set()  # the run ends while the server is down
        time.sleep(9.5)  # longer than the 5 tries 2 s apart the worker used to make
        assert t.is_alive()
        assert json.loads((tmp_path / "runs" / str(eid) / "result.json").read_text())["status"] == "ok"
    finally:
        pg_server.resume()
    t.join(60)
    assert not t.is_alive() and out["code"] == 0
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok" and row["result"] == fake_result(spec("across a restart"))


@pytest.mark.e2e
@pytest.mark.postgres
def test_an_idle_worker_survives_a_postgres_restart(pg_server):
    url = pg_server.url(pg_server.new_database())
    engine = open_db(url)
    proc = start_worker(url, "--max-backoff-s", "1")
    try:
        wait_for(lambda: fresh_heartbeat(engine), timeout_s=60)
        pg_server.pause()
        time.sleep(5)
        assert proc.poll() is None, "the worker quit during the outage"
        pg_server.resume()
        time.sleep(1.5)
        wait_for(lambda: fresh_heartbeat(engine, 1.5), timeout_s=40)
        assert proc.poll() is None
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and "store unavailable" in out, out[-2000:]
