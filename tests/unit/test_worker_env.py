"""Issue 21 items 12-13: a launch that fails because of the host puts the job back in the queue; nothing is left
behind by a full disk (no empty temp files, the log reader keeps draining); each run's temp folder (torchelastic's
log folders) is removed after it; `gc` removes what finished or deleted runs left and nothing a live run uses. With
the real launcher (multiprocess): a full runs folder pauses the worker without burning a job, then the job runs once
there is space; a real run through it leaves no torchelastic folder behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.atomic_io import write_atomic
from backend.cli import main
from backend.worker.service import Worker
from db import queries as q
from db.session import REPO, forget_engines, open_db
from tests.helpers.launch import cli_process
from tests.helpers.store_helpers import SmallFs, fake_result, spec
from tests.helpers.worker_helpers import FakeRunner, wait_for

PY = sys.executable


@pytest.fixture
def small_fs(tmp_path):
    fs = SmallFs(tmp_path / "small", "8m")
    reason = fs.mount()
    if reason:
        pytest.skip(reason)
    yield fs
    forget_engines()
    fs.unmount()


@pytest.mark.heavy
def test_a_launch_failing_because_of_the_host_puts_the_job_back(tmp_path, caplog):
    engine = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    eid = q.submit_experiment(engine, spec("unlucky"))
    runner = FakeRunner(raises=OSError(errno.ENOSPC, "No space left on device"))
    worker = Worker(engine, runs_dir=tmp_path / "runs", poll_s=0.05, runner=runner)
    t = threading.Thread(target=worker.serve, daemon=True)
    t.start()
    time.sleep(2)
    worker.stop()
    t.join(30)
    assert q.get_status(engine, eid) == "queued" and 1 <= len(runner.calls) <= 2  # not once per poll
    assert "put back in the queue" in caplog.text


def test_write_atomic_on_a_full_disk_leaves_no_temp_file(small_fs):
    small_fs.fill()
    with pytest.raises(OSError):
        write_atomic(small_fs.path / "result.json", "x" * 100_000)
    assert sorted(p.name for p in small_fs.path.iterdir()) == [".filler"]


@pytest.mark.heavy
def test_the_log_reader_keeps_draining_when_the_log_disk_is_full(small_fs):
    from backend.launch.procs import Job

    small_fs.fill()
    cmd = [PY, "-c", "import sys\nfor i in range(100_000): print('line', i, 'x' * 40)\nprint('last line')"]
    job = Job(cmd, env=dict(os.environ), cwd=REPO, job_id="full-log", log_path=small_fs.path / "log.txt")
    deadline = time.monotonic() + 60
    while job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    rc = job.poll()
    if rc is None:
        job.terminate(1.0)
    job.close()
    assert rc == 0, "the job blocked on a pipe nobody drained"
    assert "last line" in job.tail() and "log.txt stopped" in job.tail()


def test_each_job_gets_a_temp_folder_of_its_own_removed_after_the_run(tmp_path):
    engine = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    eid = q.submit_experiment(engine, spec("tmp"))
    seen = {}

    def runner(s, *, workdir, extra_env=None, **_):
        tmp = Path(extra_env["TMPDIR"])
        seen["tmp"], seen["existed"] = tmp, tmp.is_dir()
        (tmp / "torchelastic_abc").mkdir()  # what torchrun leaves behind
        return fake_result(s)

    Worker(engine, runs_dir=tmp_path / "runs", runner=runner).serve(once=True)
    assert q.get_status(engine, eid) == "ok" and seen["existed"]
    assert seen["tmp"].name.startswith(f"shardlab-job-{eid}-") and not seen["tmp"].exists()


def test_gc_removes_what_finished_and_deleted_runs_left_and_nothing_in_use(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = open_db(url)
    kept, deleted, running = q.submit_experiments(engine, [spec("kept"), spec("deleted"), spec("running")])
    uids = q.run_uids(engine)
    runs, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()

    def folder(path: Path, stamp: str | None = None, old: bool = True) -> Path:
        path.mkdir(parents=True)
        (path / "log.txt").write_text("x" * 1000)
        if stamp:
            (path / "run.json").write_text(json.dumps({"run_uid": stamp}))
        if old:
            os.utime(path, (time.time() - 7200, time.time() - 7200))
        return path

    keep = [folder(runs / str(kept), uids[kept]), folder(runs / str(running), "whatever: it is running"),
            folder(runs / "notes"), folder(tmp / f"shardlab-job-{running}-abc"),
            folder(tmp / "torchelastic_new", old=False), folder(tmp / "torchelastic_in_use"), folder(tmp / "unrelated")]
    gone = [folder(runs / str(deleted), uids[deleted]), folder(runs / f"{kept}.stale-123"),
            folder(runs / "999", "a deleted run's uid"), folder(runs / str(kept + 1000)),
            folder(tmp / f"shardlab-job-{kept}-xyz"), folder(tmp / f"shardlab-trace-{deleted}-q1"),
            folder(tmp / "torchelastic_old")]
    q.delete_experiment(engine, deleted)
    q.claim_next(engine, "w")  # kept -> running, then finished
    q.store_result(engine, kept, fake_result(spec("kept")))
    q.claim_next(engine, "w")
    q.claim_next(engine, "w")
    assert q.get_status(engine, running) == "running"
    user = subprocess.Popen(["sleep", "60"], env={**os.environ, "TMPDIR": str(tmp / "torchelastic_in_use")})
    try:
        assert main(["gc", "--db", url, "--runs-dir", str(runs), "--json", "--dry-run"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert all(Path(p).exists() for p in gone)
        from backend.worker.cleanup import collect

        report = collect(engine, [runs], tmp_dir=tmp)
    finally:
        user.kill()
        user.wait()
    assert sorted(r["path"] for r in report.removed) == sorted(map(str, gone))
    assert all(not p.exists() for p in gone) and all(p.exists() for p in keep)
    assert 1000 * len(gone) <= report.bytes < 1200 * len(gone) and report.kept_in_use >= 2
    assert {r["path"] for r in planned["removed"]} >= {str(p) for p in gone if p.parent == runs}


def test_gc_refuses_a_negative_age_which_would_race_a_starting_run(tmp_path, monkeypatch, capsys):
    """--older-than-h -5 put the cutoff in the future, so every temp folder counted as old (a run starting now too)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    job = tmp_path / "tmp" / "shardlab-job-1-fresh"
    job.mkdir(parents=True)
    assert main(["gc", "--db", f"sqlite:///{tmp_path / 's.db'}", "--older-than-h", "-5"]) == 2
    assert "--older-than-h must be >= 0" in capsys.readouterr().err and job.is_dir()


def test_gc_leaves_another_store_s_run_folders_alone_in_a_shared_runs_dir(tmp_path, capsys):
    """A store at /elsewhere/store.db judged the checkout's data/runs (the SLURM config's default run_dir) by its own
    ids and would have removed the other store's runs 1 and 2 ("its experiment was deleted", "stamped for another
    run with the same id"). In a runs dir it does not own, gc removes set-aside folders only."""
    url = f"sqlite:///{tmp_path / 'mine' / 'store.db'}"
    (tmp_path / "mine").mkdir()
    engine = open_db(url)
    (mine,) = q.submit_experiments(engine, [spec("mine")])
    shared = tmp_path / "shared_runs"
    foreign = [shared / str(mine), shared / str(mine + 1)]
    for i, path in enumerate(foreign):
        path.mkdir(parents=True)
        (path / "run.json").write_text(json.dumps({"run_uid": f"another store's run {i}"}))
    stale = shared / f"{mine}.stale-123"
    stale.mkdir()
    from backend.worker.cleanup import collect, owned_runs_dirs

    assert owned_runs_dirs(engine) == {(tmp_path / "mine" / "runs").resolve()}
    report = collect(engine, [tmp_path / "mine" / "runs", shared], tmp_dir=tmp_path / "no_tmp")
    assert [r["path"] for r in report.removed] == [str(stale)]
    assert all(p.exists() for p in foreign)
    assert main(["gc", "--db", url, "--runs-dir", str(shared), "--json", "--dry-run"]) == 0
    assert {r["path"] for r in json.loads(capsys.readouterr().out)["removed"]} >= {str(foreign[1])}


# ---- in processes of their own ----------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_full_runs_folder_pauses_the_worker_and_burns_no_job(small_fs, tmp_path, caplog):
    engine = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    ids = q.submit_experiments(engine, [spec(str(i)) for i in range(4)])
    small_fs.fill()
    worker = Worker(engine, runs_dir=small_fs.path / "runs", poll_s=0.05)  # the real launcher
    worker.min_free_bytes, worker.max_backoff_s = 1 << 20, 0.5
    caplog.set_level(logging.WARNING, logger="shardlab.worker")
    t = threading.Thread(target=worker.serve, daemon=True)
    t.start()
    try:
        time.sleep(3)
        assert [q.get_status(engine, i) for i in ids] == ["queued"] * 4
        assert "No space left on device" in caplog.text or "MiB free" in caplog.text
        assert not list(small_fs.path.rglob("*.tmp")) and not list(small_fs.path.rglob(".*.tmp"))
        small_fs.free()
        wait_for(lambda: q.get_status(engine, ids[0]) != "queued", timeout_s=30)
    finally:
        small_fs.free()
        worker.stop()
        t.join(60)
    assert [q.get_status(engine, i) for i in ids[1:]] == ["queued"] * 3
    assert q.get_status(engine, ids[0]) in ("interrupted", "ok")
    assert "claiming jobs again" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_run_through_the_worker_leaves_no_torchelastic_folder(tmp_path):
    # The worker's own temp root: other tests' killed workers leave shardlab-job-1-* in the shared one for gc.
    worker_tmp = tmp_path / "tmp"
    worker_tmp.mkdir()

    def elastic() -> set[str]:
        return {p.name for p in worker_tmp.glob("torchelastic_*")}

    url = f"sqlite:///{tmp_path / 'store.db'}"
    eid = q.submit_experiment(open_db(url), spec("real"))
    before = elastic()
    done = cli_process("worker", "--db", url, "--once", "--runs-dir", str(tmp_path / "runs"), timeout_s=300,
                       env={"TMPDIR": str(worker_tmp)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert q.get_status(open_db(url), eid) == "ok"
    assert elastic() - before == set()
    assert not list(worker_tmp.glob(f"shardlab-job-{eid}-*"))
