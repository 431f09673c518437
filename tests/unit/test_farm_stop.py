"""The farm's stop() (tests/helpers/farm.py), called from the session's teardown on an interrupt while the farm's
thread launches: the running launch is killed, a launch starting at that moment too, and no other launch starts."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from tests.helpers import farm as farm_mod
from tests.helpers.farm import Farm, JobFailed, program_job


def test_a_stopped_farm_launches_nothing(tmp_path):
    job = program_job("selftest", 2)
    farm = Farm(tmp_path, [job])
    farm.stop()
    farm.run()
    assert not list(tmp_path.glob("launch-*.log")) and (tmp_path / "done").exists()
    with pytest.raises(JobFailed, match="finished without running"):
        farm.result(job)


def test_stop_while_a_launch_starts_kills_it_and_launches_no_other(tmp_path, monkeypatch):
    """stop() lands after Popen returned and before the launch is registered as the running one (the window a
    handle set after Popen leaves open): the launch is killed as it registers, its job recorded as failed."""
    real_popen, started = subprocess.Popen, []
    jobs = [program_job("selftest", 2, timeout_s=120), program_job("selftest", 2, timeout_s=120, after=True)]
    farm = Farm(tmp_path, jobs)

    def popen_then_stop(cmd, **kwargs):  # a stand-in launch: the farm's own options, a process that would run 30 s
        proc = real_popen(["sleep", "30"], **kwargs)
        started.append(proc)
        farm.stop()
        return proc

    monkeypatch.setattr(farm_mod.subprocess, "Popen", popen_then_stop)
    t0 = time.monotonic()
    farm.run()
    assert time.monotonic() - t0 < 15 and len(started) == 1  # killed at once; the second job not launched again
    assert started[0].returncode is not None and not psutil.pid_exists(started[0].pid)
    assert farm.proc is None
    with pytest.raises(JobFailed, match=r"failed: torchrun killed by SIGKILL"):
        farm.result(jobs[0])
    with pytest.raises(JobFailed, match="finished without running"):
        farm.result(jobs[1])
