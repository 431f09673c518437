"""The launcher without launching: torchrun command line, failure attribution, pre-launch checks.

Real runs: test_multinode.py (ok path, progress, result file), test_failures.py, test_run_cli.py. On real processes
(multiprocess): ending a job ends workers in their own sessions, a dead launcher takes its job down."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from backend.launch import outcome, torchrun
from backend.launch.launcher import run_experiment, write_atomic
from backend.result import RunResult, Status
from tests.helpers.specs import stored_spec, tiny_spec

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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_timed_out_run_stores_the_predicted_peak_an_ok_run_stores(compiled: bool) -> None:
    """The failed path stored total_bytes (the activation peak, 647,708 B here), the ok path the fullest moment (the
    loss's backward, 664,092 B), and of the eager twin for a compiled spec (the memory-tracked step's blocks)."""
    from backend.engine.assemble import assemble_result
    from backend.launch.launcher import failed_result

    spec = tiny_spec()
    if compiled:
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"elementwise": "compiled"})})
    payload = {"ranks": [{"rank": r, "step_s": [0.1], "losses": [1.0], "coords": spec.parallel.coords(r)}
                         for r in range(2)]}
    ok = assemble_result(spec, payload)
    timed_out = failed_result(spec, outcome.Failure(Status.TIMEOUT, "timed out"), {})
    assert [r.predicted for r in timed_out.per_rank] == [r.predicted for r in ok.per_rank]
    assert [r.comm_predicted for r in timed_out.per_rank] == [r.comm_predicted for r in ok.per_rank]


def test_cancel_before_launch_spawns_nothing(tmp_path: Path) -> None:
    import threading

    cancel = threading.Event()
    cancel.set()
    res = run_experiment(tiny_spec(), workdir=tmp_path, cancel=cancel)
    assert res.status == Status.CANCELLED and not (tmp_path / "log.txt").exists()
    assert [r.rank for r in res.per_rank] == [0, 1] and res.per_rank[0].predicted.params_bytes > 0


def test_a_failed_result_keeps_a_spec_that_todays_rules_refuse(tmp_path: Path) -> None:
    """The result of a run that failed (here: cancelled before launch) takes its spec as it is: re-judging it with the
    runnable checks raised instead of returning the failure (a db9cb05 spec: ep with the allgather dispatcher)."""
    import threading

    from backend.spec import READ_BACK, ExperimentSpec

    spec = ExperimentSpec.model_validate_json(stored_spec("ep_allgather_db9cb05"), context=READ_BACK)
    cancel = threading.Event()
    cancel.set()
    res = run_experiment(spec, workdir=tmp_path, cancel=cancel)
    assert res.status == Status.CANCELLED and res.error == "cancelled before launch" and res.spec == spec
    assert RunResult.model_validate_json((tmp_path / "result.json").read_text(), context=READ_BACK).spec == spec


# ---- in processes of their own ----------------------------------------------------------------------------

SPAWNER = """
import subprocess, sys, time
# like torchrun: a worker in its own session, so killing our process group alone would miss it
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("started", flush=True)
time.sleep(120)
"""


@pytest.mark.multiprocess
def test_terminate_ends_workers_in_their_own_sessions(tmp_path: Path) -> None:
    from backend.launch.procs import Job, job_processes

    env, job_id = torchrun.build_env()
    job = Job([sys.executable, "-c", SPAWNER], env=env, cwd=tmp_path, job_id=job_id, log_path=tmp_path / "log.txt")
    deadline = time.monotonic() + 60
    while len(job_processes(job_id)) < 2 and time.monotonic() < deadline:
        job.poll()
        time.sleep(0.1)
    assert len(job_processes(job_id)) == 2
    job.terminate(grace_s=5)
    job.close()
    assert job.proc.returncode == -15  # torchrun's real status: psutil must not reap it behind Popen's back
    assert job_processes(job_id, job.pgid) == []
    assert "started" in job.tail()


FORWARDER = """
import signal, subprocess, sys, time
# like torchrun: the SIGTERM handler is in place before any worker starts; on SIGTERM, end the worker
# (in its own session) and exit. The death signal can come more than once (the kernel sends it again each time
# the orphan is re-parented, e.g. from the launcher's main thread to its log-reader thread and then to init); a
# re-entered handler would deadlock on Popen's waitpid lock, so later ones are ignored.
child = None
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if child is not None:
        child.terminate(); child.wait()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("ready", flush=True)
time.sleep(120)
"""


LAUNCHER = """
import sys, time
from pathlib import Path
from backend.launch import torchrun
from backend.launch.procs import Job
env, job_id = torchrun.build_env({torchrun.JOB_ENV: sys.argv[1]})
Job([sys.executable, "-c", sys.argv[2]], env=env, cwd=Path("."), job_id=job_id, log_path=Path(sys.argv[3]))
time.sleep(120)
"""


@pytest.mark.multiprocess
def test_launcher_death_ends_the_job(tmp_path: Path) -> None:
    """SIGKILL of the launcher itself: torchrun gets SIGTERM (PR_SET_PDEATHSIG) and ends its workers."""
    import os
    import signal
    import subprocess
    import uuid

    from backend.launch.procs import job_processes

    job_id = f"test-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "PYTHONPATH": str(torchrun.ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, job_id, FORWARDER, str(tmp_path / "log.txt")], env=env)
    try:
        log = tmp_path / "log.txt"
        deadline = time.monotonic() + 60
        # "ready": the worker has started and its handle is set (a SIGTERM in between would leave it behind,
        # a window that torchrun does not have and that this test is not about)
        while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(job_processes(job_id)) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while job_processes(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_processes(job_id)
        assert left == [], f"left behind: {_describe(left)}"
    finally:
        launcher.kill()
        for p in job_processes(job_id):
            p.kill()


def _describe(procs: list) -> list[str]:
    import psutil

    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ppid {p.ppid()} {p.status()} {' '.join(p.cmdline())[-60:]!r}")
        except psutil.Error as e:
            out.append(f"pid {p.pid}: {e}")
    return out


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_child_of_an_already_dead_launcher_ends_itself() -> None:
    """The launcher may die between fork and prctl: the death signal would never come, so the child checks."""
    import functools
    import os
    import subprocess

    from backend.launch.procs import _die_with_launcher

    def start(launcher_pid: int) -> int:
        return subprocess.run([sys.executable, "-c", "pass"], timeout=60,
                              preexec_fn=functools.partial(_die_with_launcher, launcher_pid)).returncode

    assert start(os.getpid()) == 0
    assert start(os.getpid() + 1_000_000) == 128 + 15  # not our parent: as if the launcher were gone
