"""The SLURM executor's parts that need no cluster: config checks, the batch script, adoption of the jobs
of gone workers (on SQLite and PostgreSQL)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest

from backend.cluster.reattach import adopt
from backend.cluster.script import build_script, time_limit
from backend.cluster.slurm_config import ClusterConfigError, SlurmConfig, load
from backend.spec import validate_spec
from db import queries as q
from tests.helpers.worker_helpers import SLURM_TINY, slurm_spec


def test_the_script_takes_the_rendezvous_from_nodeaddr_and_parses(tmp_path):
    cfg = SlurmConfig(partition="gpu", account="ml-infra", gpus_per_node=2, extra_sbatch=["#SBATCH --exclusive"])
    script = build_script(slurm_spec(timeout_s=90.5), cfg, experiment_id=12, workdir=tmp_path / "12")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --account=ml-infra", "#SBATCH --gpus-per-node=2", "#SBATCH --time=1:31",
                 "#SBATCH --no-requeue", "#SBATCH --exclusive"):
        assert line in script.splitlines(), line
    assert "NodeAddr" in script and "--local-addr" in script and "--nproc-per-node 2" in script
    assert "-m backend.engine.rank" in script and "srun --nodes=2" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_deepspeed_spec_runs_deepspeeds_rank_program_and_jax_is_refused(tmp_path, monkeypatch):
    """The job script started ShardLab's torch engine for every spec: a DeepSpeed run on SLURM measured FSDP2 and was
    assembled and stored as DeepSpeed's. It now runs the framework's rank program; JAX (one process of virtual
    CPU devices, no torchrun) is refused before anything is queued."""
    from backend.cluster.submit import cluster_problem

    monkeypatch.setenv("SHARDLAB_CLUSTER_CONFIG", str(tmp_path / "shardlab.toml"))
    (tmp_path / "shardlab.toml").write_text(f'[slurm]\nrun_dir = "{tmp_path}"\n')
    spec, problems = validate_spec({**SLURM_TINY, "framework": "deepspeed",
                                    "parallel": {"strategy": "zero3", "world_size": 4},
                                    "runtime": {"executor": "slurm", "nnodes": 2}})
    assert not problems, problems
    script = build_script(spec, SlurmConfig(), experiment_id=3, workdir=tmp_path / "3")
    assert "-m backend.frameworks.deepspeed.rank" in script and "-m backend.engine.rank" not in script
    assert cluster_problem(spec) is None
    jax, problems = validate_spec({**SLURM_TINY, "framework": "jax", "parallel": {"strategy": "ddp", "world_size": 2},
                                   "runtime": {"executor": "slurm", "nnodes": 1}})
    assert not problems, problems
    assert "framework jax runs in one process" in cluster_problem(jax)


def test_time_limit_and_rank_placement_arithmetic():
    assert time_limit(slurm_spec(timeout_s=600), SlurmConfig()) == "10:00"
    assert time_limit(slurm_spec(), SlurmConfig(time_limit="02:00:00")) == "02:00:00"
    assert SlurmConfig().check_spec(3, 2) == "world_size=3 is not divisible by nodes=2"
    assert SlurmConfig(gpus_per_node=8).check_spec(8, 2) == \
        "world_size=8 != nodes 2 x gpus_per_node 8 = 16: a GPU cluster runs one rank per GPU"
    assert SlurmConfig(gpus_per_node=8).check_spec(16, 2) is None


def test_a_run_dir_a_batch_line_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ValueError, match="run folder"):
        build_script(slurm_spec(), SlurmConfig(), experiment_id=1, workdir=tmp_path / "a b" / "1")


def test_config_file_errors_name_the_file(tmp_path, monkeypatch):
    bad = tmp_path / "shardlab.toml"
    bad.write_text('[slurm]\npartition = "gpu; rm -rf /"\n')
    with pytest.raises(ClusterConfigError, match="(?s)shardlab.toml.*not a SLURM name"):
        load(bad)
    monkeypatch.setenv("SHARDLAB_CLUSTER_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ClusterConfigError, match="does not exist"):
        load()
    bad.write_text('[slurm]\nbogus = 1\n')
    with pytest.raises(ClusterConfigError, match="bogus"):
        load(bad)


def test_a_relative_run_dir_is_the_config_files_not_the_current_folder(tmp_path, monkeypatch):
    """run_dir = "runs" in shardlab.toml means <that file's folder>/runs whatever folder the worker starts in: a worker
    restarted elsewhere must find its jobs' folders (slurm.json) again instead of submitting them anew."""
    conf = tmp_path / "site" / "shardlab.toml"
    conf.parent.mkdir()
    conf.write_text('[slurm]\nrun_dir = "runs"\n')
    for cwd in (tmp_path, conf.parent):
        monkeypatch.chdir(cwd)
        assert load(conf).run_dir == conf.parent / "runs"


def test_a_config_error_names_the_key_and_value_without_pydantic_noise(tmp_path):
    bad = tmp_path / "shardlab.toml"
    bad.write_text('[slurm]\npartiton = "gpu"\ntime_limit = "1 hour"\n')
    with pytest.raises(ClusterConfigError) as e:
        load(bad)
    text = str(e.value)
    assert "[slurm] partiton: Extra inputs are not permitted (got 'gpu')" in text
    assert "[slurm] time_limit: time_limit '1 hour' is not a SLURM time" in text
    assert "errors.pydantic.dev" not in text and "\n" not in text


def test_a_starting_worker_adopts_only_slurm_runs_of_gone_workers(store_urls):
    engine = store_urls.engine()
    me = psutil.Process()
    q.register_worker(engine, "gone", pid=me.pid, host="h", pid_started=me.create_time())
    q.register_worker(engine, "alive", pid=me.pid, host="h", pid_started=me.create_time())
    local, _ = validate_spec({**SLURM_TINY, "parallel": {"strategy": "ddp", "world_size": 2}})
    ids = q.submit_experiments(engine, [slurm_spec(), slurm_spec(), local])
    for eid, wid in zip(ids, ("gone", "alive", "gone"), strict=False):
        assert q.claim_next(engine, wid, host="h") == eid
    q.set_worker_state(engine, "gone", "stopped")
    q.register_worker(engine, "new", pid=me.pid, host="h", pid_started=me.create_time())  # as Worker.serve does
    assert adopt(engine, "new", "h") == [ids[0]]
    rows = {r["id"]: r for r in q.list_experiments(engine)}
    assert rows[ids[0]]["worker_id"] == "new" and rows[ids[0]]["status"] == "running"
    assert rows[ids[1]]["worker_id"] == "alive" and rows[ids[2]]["worker_id"] == "gone"
    assert adopt(engine, "newer", "h") == []  # "new" is alive: a second starting worker takes nothing


def test_a_job_that_vanished_without_a_result_is_failed_with_reason_and_log_tail(tmp_path, monkeypatch):
    """Neither squeue nor scontrol knows the job any more (purged after MinJobAge, or the controller lost it)."""
    import json

    from backend.cluster import runner, slurm

    run_dir = tmp_path / "runs" / "5"
    run_dir.mkdir(parents=True)
    (run_dir / "slurm.json").write_text(json.dumps({"job_id": "999"}))
    (run_dir / "slurm-999.out").write_text("SHARDLAB_SLURM job 999 nodes node[1-2]\nlast words of the job\n")
    monkeypatch.setattr(slurm, "query", lambda job_id: slurm.JobState("VANISHED", "Invalid job id specified"))
    res = runner.run_on_slurm(slurm_spec(), workdir=Path("5"), config=SlurmConfig(run_dir=tmp_path / "runs"))
    assert res.status == "failed" and "vanished from the queue without a result (Invalid job id specified)" in res.error
    assert "last words of the job" in res.log_tail and res.env["launch"]["reattached"] is True
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"
