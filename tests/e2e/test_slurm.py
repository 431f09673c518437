"""Runs on a real SLURM cluster started by the tests (slurmctld + two slurmd nodes on 127.0.0.1, see
tests/helpers/slurm_cluster.py): submitted through the CLI, run by the worker's SLURM runner, collected into the
store like a local run; and the failures (cancel, a rank that raises, the time limit, a slurmd killed
mid-job) stored as failed with SLURM's state, the traceback or log tail, and no process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from backend.cli import build_parser, main
from backend.cli.spec_flags import spec_from_args
from db import queries as q
from db.session import REPO, open_db
from tests.helpers.farm import engine_job, uses
from tests.helpers.slurm_cluster import SlurmCluster, unavailable_reason

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PY = sys.executable
TINY = ["--strategy", "ddp", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
        "--micro-batch", "1", "--steps", "2", "--warmup-steps", "1"]
NAME = "x; `id`"


def local_twin(world: int):
    """The farm job of what `submit` queues for `world` ranks on this host (executor local, one node): the local run
    a SLURM run is compared with. The farm runs it in its launch of that world size, beside the other tests' jobs,
    instead of a worker process and a torchrun launch of its own (~25-40 CPU-s of imports each)."""
    args = build_parser("submit").parse_args(["submit", *TINY, "--world", str(world), "--global-batch", str(world),
                                              "--name", NAME])
    spec, problems = spec_from_args(args)
    assert not problems, problems
    return engine_job(spec)


LOCAL_TWINS = {world: local_twin(world) for world in (2, 4)}


def twin_of(world: int) -> tuple:
    """The farm mark of the local twin, none where the tests have no cluster (they skip: the farm need not run it)."""
    return () if unavailable_reason() else (uses(LOCAL_TWINS[world]),)


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster().start()
    yield c
    c.stop()


@pytest.fixture
def env(cluster, tmp_path, monkeypatch):
    """SLURM_CONF and a cluster config whose shared run_dir is in tmp_path, for this process and its children."""
    cfg = tmp_path / "shardlab.toml"
    cfg.write_text(f'[slurm]\nrun_dir = "{tmp_path / "cluster-runs"}"\nextra_sbatch = ["#SBATCH --exclusive"]\n')
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("SHARDLAB_CLUSTER_CONFIG", str(cfg))
    cluster.resume_all()
    yield {**os.environ, "OMP_NUM_THREADS": "1"}
    left = job_processes()
    for p in left:
        p.kill()
    assert left == [], f"processes left behind: {[(p.pid, p.info) for p in left]}"


def job_processes() -> list[psutil.Process]:
    """Ranks, torchruns and srun/bash of our jobs (our session tag is in their inherited environment)."""
    tag, found = os.environ["SHARDLAB_TEST_SESSION"], []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if ("backend.engine.rank" in cmd or "job.sbatch" in cmd) \
                    and p.environ().get("SHARDLAB_TEST_SESSION") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_no_job_processes(timeout_s: float = 60) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := job_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def submit(capsys, url: str, *flags: str) -> int:
    assert main(["submit", "--db", url, "--executor", "slurm", *TINY, *flags]) == 0
    return int(capsys.readouterr().out)


def worker(url: str, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "backend", "worker", "--db", url, "--poll-s", "0.2", "--heartbeat-s", "1",
                             *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_once(url: str, env: dict, timeout: float = 300) -> str:
    w = worker(url, env, "--once")
    out, _ = w.communicate(timeout=timeout)
    assert w.returncode == 0, out
    return out


def wait_status(engine, eid: int, want, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = q.get_experiment(engine, eid)
        if want(row):
            return row
        time.sleep(0.3)
    raise AssertionError(f"experiment {eid}: timed out; last {row['status']} {row['progress_phase']} {row['error']}")


def shape(result) -> list[tuple]:
    return [(r.rank, sorted(r.measured.model_dump()), sorted(r.predicted.model_dump()), sorted(r.error_pct),
             sorted(r.comm), sorted(r.comm_predicted)) for r in result.per_rank]


@pytest.mark.parametrize("world,nodes", [pytest.param(2, 2, marks=twin_of(2), id="2x1"),
                                         pytest.param(4, 2, marks=twin_of(4), id="2x2")])
def test_cli_submission_runs_on_two_nodes_like_a_local_run(env, farm, capsys, tmp_path, world, nodes):
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", str(world), "--nodes", str(nodes), "--global-batch", str(world), "--name",
                 NAME)
    run_once(url, env)
    engine = open_db(url)
    row = q.get_experiment(engine, eid)
    res = row["result"]
    assert row["status"] == "ok", (row["error"], row["log_tail"])
    launch = res.env["launch"]
    assert launch["executor"] == "slurm" and launch["slurm_state"] == "COMPLETED" and launch["nodes"] == "node[1-2]"
    run_dir = tmp_path / "cluster-runs" / str(eid)
    script = (run_dir / "job.sbatch").read_text()
    assert f"#SBATCH --nodes={nodes}" in script and f"--nproc-per-node {world // nodes}" in script
    assert "`id`" not in script and "#SBATCH --exclusive" in script
    assert (len(res.per_rank) == world
            and all(r.measured.params_bytes > 0 and r.predicted.params_bytes > 0 for r in res.per_rank))
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff < 1e-4
    # the same spec run locally (the farm's run of it; a local run through the worker and the store is
    # tests/unit/test_worker.py's test_submit_then_worker_once_stores_a_real_run): identical result shape, identical
    # (deterministic) measured parameter bytes
    data = row["spec"].model_dump(mode="json")
    data["runtime"].update(executor="local", nnodes=1)
    local_spec = type(row["spec"]).model_validate(data)
    twin = LOCAL_TWINS[world]
    assert type(local_spec).from_json(twin.payload) == local_spec, "the farm's local run is not this spec"
    local = farm.result(twin)["result"]
    assert local.status == "ok" and shape(local) == shape(res)
    assert [r.measured.params_bytes for r in local.per_rank] == [r.measured.params_bytes for r in res.per_rank]
    assert [r.predicted.model_dump() for r in local.per_rank] == [r.predicted.model_dump() for r in res.per_rank]


def test_a_deepspeed_submission_runs_deepspeed_on_two_nodes(env, capsys, tmp_path):
    """The job script runs the spec's framework's rank program: DeepSpeed's ZeRO-3 engine, measured as DeepSpeed
    (its model states beside DeepSpeed's own estimate), not ShardLab's FSDP2 engine stored under DeepSpeed's name."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2", "--framework", "deepspeed",
                 "--strategy", "zero3")
    run_once(url, env)
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "ok", (row["error"], row["log_tail"])
    assert "-m backend.frameworks.deepspeed.rank" in (tmp_path / "cluster-runs" / str(eid) / "job.sbatch").read_text()
    res = row["result"]
    assert res.framework_facts.get("framework") == "deepspeed" and res.framework_facts.get("deepspeed")
    assert all(r.model_states_measured is not None and r.model_states_measured.total_bytes > 0 for r in res.per_rank)
    assert wait_no_job_processes() == []


def test_a_rank_that_raises_fails_the_job_with_its_traceback(env, capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2")
    run_once(url, {**env, "SHARDLAB_FAULT": "raise:rank=1:step=1"})
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "failed", row["error"]
    assert "SLURM job" in row["error"] and "FAILED" in row["error"] and "injected fault on rank 1" in row["error"]
    assert row["failing_rank"] == 1 and "RuntimeError: injected fault" in row["traceback"]
    assert row["log_tail"] and row["result"].per_rank[0].predicted.params_bytes > 0
    assert wait_no_job_processes() == []


def test_cancel_in_the_store_scancels_the_job(env, capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2")
    engine = open_db(url)
    w = worker(url, {**env, "SHARDLAB_FAULT": "hang:rank=0:step=1"}, "--once")
    try:
        wait_status(engine, eid, lambda r: r["progress_step"] is not None, timeout_s=180)
        assert q.cancel_experiment(engine, eid) == "cancelling"
        out, _ = w.communicate(timeout=120)
    finally:
        if w.poll() is None:
            w.kill()
    row = q.get_experiment(engine, eid)
    assert row["status"] == "cancelled" and "CANCELLED" in row["error"], (row["error"], out)
    assert wait_no_job_processes() == []


def test_a_job_over_its_time_limit_is_stored_as_timeout(env, capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2", "--timeout", "20")
    run_once(url, {**env, "SHARDLAB_FAULT": "hang:rank=0:step=1"}, timeout=400)
    row = q.get_experiment(open_db(url), eid)
    assert row["status"] == "timeout" and "TIMEOUT" in row["error"], row["error"]
    assert "#SBATCH --time=0:20" in (tmp_path / "cluster-runs" / str(eid) / "job.sbatch").read_text()
    assert row["log_tail"]
    assert wait_no_job_processes() == []


def test_a_slurmd_killed_mid_job_fails_the_run_with_node_fail(env, cluster, capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2")
    engine = open_db(url)
    w = worker(url, {**env, "SHARDLAB_FAULT": "hang:rank=0:step=1"}, "--once")
    try:
        wait_status(engine, eid, lambda r: r["progress_step"] is not None, timeout_s=180)
        cluster.kill_node("node2")
        out, _ = w.communicate(timeout=300)
    finally:
        if w.poll() is None:
            w.kill()
    row = q.get_experiment(engine, eid)
    assert row["status"] == "failed" and "NODE_FAIL" in row["error"], (row["error"], out)
    assert row["log_tail"]
    cluster.resume_all()  # the restarted slurmd ends the job's processes it finds on node2
    assert wait_no_job_processes(90) == []


def test_submit_refuses_a_spec_the_cluster_cannot_hold(env, capsys, tmp_path):
    cfg = Path(os.environ["SHARDLAB_CLUSTER_CONFIG"])
    cfg.write_text(cfg.read_text() + "gpus_per_node = 4\n")
    code = main(["submit", "--db", f"sqlite:///{tmp_path / 's.db'}", "--executor", "slurm", *TINY, "--world", "2",
                 "--nodes", "2", "--global-batch", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "world_size=2 != nodes 2 x gpus_per_node 4 = 8" in err


def test_a_stopped_worker_leaves_its_slurm_job_running_and_the_next_worker_reattaches(env, capsys, tmp_path):
    import signal

    url = f"sqlite:///{tmp_path / 's.db'}"
    eid = submit(capsys, url, "--world", "2", "--nodes", "2", "--global-batch", "2")
    record = tmp_path / "cluster-runs" / str(eid) / "slurm.json"
    w1 = worker(url, env)
    try:
        deadline = time.monotonic() + 120
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        w1.send_signal(signal.SIGTERM)
        out1, _ = w1.communicate(timeout=60)
    finally:
        if w1.poll() is None:
            w1.kill()
    assert w1.returncode == 0, out1
    engine = open_db(url)
    assert q.get_status(engine, eid) == "running", out1  # detached, not interrupted: the job runs on
    job_id = json.loads(record.read_text())["job_id"]
    out2 = run_once(url, env)
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok", (row["error"], out2)
    launch = row["result"].env["launch"]
    assert launch["reattached"] is True and launch["job_id"] == job_id and launch["slurm_state"] == "COMPLETED"
    assert len(list((tmp_path / "cluster-runs" / str(eid)).glob("slurm-*.out"))) == 1  # submitted once


def test_dashboard_submission_runs_2_nodes_x_2_ranks_on_slurm(env, tmp_path, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    at.number_input(key="f_world_size").set_value(4)
    at.number_input(key="f_global_batch").set_value(4)
    at.number_input(key="f_micro_batch").set_value(1)
    at.radio(key="f_executor").set_value("slurm").run()
    at.number_input(key="f_nnodes").set_value(2).run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("2 node(s) x 2 rank(s) per node" in c.value for c in at.caption)
    at.button(key="submit_one").click()
    at.run()
    assert not at.exception and any("Queued run #1" in s.value for s in at.success), [e.value for e in at.error]
    engine = open_db(url)
    assert (q.get_experiment(engine, 1)["spec"].runtime.executor,
            q.get_experiment(engine, 1)["spec"].runtime.nnodes) == ("slurm", 2)
    run_once(url, env)
    row = q.get_experiment(engine, 1)
    assert row["status"] == "ok", (row["error"], row["log_tail"])
    assert len(row["result"].per_rank) == 4 and row["result"].env["launch"]["nodes"] == "node[1-2]"
    at.switch_page("dashboard/pages/runs.py").run()
    assert not at.exception and list(at.dataframe[0].value["status"]) == ["ok"]
