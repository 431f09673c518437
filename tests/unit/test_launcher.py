"""The launcher without launching: torchrun command line, failure attribution, pre-launch checks.

Real runs: test_multinode.py (ok path, progress, result file), test_failures.py, test_run_cli.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from backend.launch import outcome, torchrun
from backend.launch.launcher import run_experiment, write_atomic
from backend.result import RunResult, Status
from tests.helpers.launch_helpers import tiny_spec

KILL_SUMMARY = """
tests.fixtures.ring_rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_02:59:57
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 9009)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_02:59:57
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 9010)  (SIGKILL)
  error_file: <N/A>
============================================================
"""


def test_standalone_command() -> None:
    spec = tiny_spec()
    cmd = torchrun.build_command(spec, Path("/w/spec.json"), Path("/w"))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--rdzv-backend" not in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[-6:] == ["-m", "backend.engine.rank", "--spec", "/w/spec.json", "--out", "/w"]


def test_multinode_command_shares_rdzv_id() -> None:
    nodes = [tiny_spec(nnodes=2, node_rank=r, rdzv_endpoint="127.0.0.1:29999") for r in (0, 1)]
    cmds = [torchrun.build_command(s, Path("/w/spec.json"), Path("/w")) for s in nodes]
    for r, cmd in enumerate(cmds):
        assert "--standalone" not in cmd
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == str(r)
        assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:29999"
        assert cmd[cmd.index("--nproc-per-node") + 1] == "1"
    ids = {cmd[cmd.index("--rdzv-id") + 1] for cmd in cmds}
    assert len(ids) == 1
    other = tiny_spec(nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29998")
    assert torchrun.rdzv_id(other) not in ids


def test_env_sets_threads_path_and_job_tag() -> None:
    env, job_id = torchrun.build_env({"SHARDLAB_FAULT": "raise:rank=0:step=0"})
    assert env["OMP_NUM_THREADS"] == "1" and env["SHARDLAB_FAULT"] == "raise:rank=0:step=0"
    assert env["PYTHONPATH"].split(":")[0] == str(torchrun.ROOT)
    assert env[torchrun.JOB_ENV] == job_id
    assert torchrun.build_env({torchrun.JOB_ENV: "mine"})[1] == "mine"


def test_torchrun_root_cause_names_the_killed_rank() -> None:
    assert outcome.torchrun_root_cause(KILL_SUMMARY) == (3, -9)
    assert outcome.torchrun_root_cause("no summary here") is None


def _error_file(d: Path, rank: int, error: str, t: float, kind: str = "error") -> None:
    (d / f"rank-{rank}.error.json").write_text(json.dumps(
        {"rank": rank, "error": error, "traceback": f"Traceback...\n{error}", "kind": kind, "time_unix": t}))


def test_root_cause_beats_peers_that_saw_it_die(tmp_path: Path) -> None:
    _error_file(tmp_path, 0, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", t=1.0)
    _error_file(tmp_path, 1, "RuntimeError: injected fault on rank 1 at step 1", t=2.0)
    f = outcome.classify_exit(tmp_path, 1, "")
    assert (f.status, f.failing_rank) == (Status.FAILED, 1)
    assert "injected fault" in f.error and "injected fault" in f.traceback


def test_oom_record_gives_oom_status(tmp_path: Path) -> None:
    _error_file(tmp_path, 1, "MemoryError: injected out-of-memory", t=1.0, kind="oom")
    assert outcome.classify_exit(tmp_path, 1, "").status == Status.OOM


def test_sigkilled_rank_without_record_is_blamed_over_its_peer(tmp_path: Path) -> None:
    _error_file(tmp_path, 0, "RuntimeError: Read error: Connection reset by peer", t=1.0)
    f = outcome.classify_exit(tmp_path, 1, KILL_SUMMARY)
    assert f.failing_rank == 3 and "SIGKILL" in f.error


PEER_FIRST_SUMMARY = """
backend.engine.rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_06:54:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 9011)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 9011
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_06:54:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 9010)
  error_file: <N/A>
============================================================
"""


def test_killed_rank_is_blamed_when_torchrun_saw_its_peer_exit_first(tmp_path: Path) -> None:
    """Under load the peer's error exit can reach torchrun before the SIGKILL: the silent killed rank is the cause."""
    _error_file(tmp_path, 0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:36050", t=1.0)
    assert outcome.torchrun_failures(PEER_FIRST_SUMMARY) == [(1, -9), (0, 1)]
    f = outcome.classify_exit(tmp_path, 1, PEER_FIRST_SUMMARY)
    assert f.failing_rank == 1 and "SIGKILL" in f.error, f.error


def test_write_atomic_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    write_atomic(path, "old")
    write_atomic(path, '{"new": true}')
    assert json.loads(path.read_text()) == {"new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_cuda_requested_without_cuda_fails_before_spawning(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    spec = tiny_spec(device="cuda")
    t0 = time.monotonic()
    res = run_experiment(spec, workdir=tmp_path)
    assert res.status == Status.FAILED and "torch.cuda.is_available() is False" in res.error
    assert not (tmp_path / "log.txt").exists()  # nothing was launched
    assert RunResult.from_json((tmp_path / "result.json").read_text()).error == res.error
    assert time.monotonic() - t0 < 30


def test_cancel_before_launch_spawns_nothing(tmp_path: Path) -> None:
    import threading

    cancel = threading.Event()
    cancel.set()
    res = run_experiment(tiny_spec(), workdir=tmp_path, cancel=cancel)
    assert res.status == Status.CANCELLED and not (tmp_path / "log.txt").exists()
    assert [r.rank for r in res.per_rank] == [0, 1] and res.per_rank[0].predicted.params_bytes > 0
