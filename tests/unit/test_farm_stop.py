"""The farm's stop() (tests/helpers/farm.py), called from the session's teardown on an interrupt while the farm's
thread launches: the running launch is killed, a launch starting at that moment too (stop() returns once it is),
no other launch starts, and stop() may be called any number of times, from any thread."""

from __future__ import annotations

import signal
import subprocess
import threading
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
    assert not farm.procs
    with pytest.raises(JobFailed, match=r"failed: torchrun killed by SIGKILL"):
        farm.result(jobs[0])
    with pytest.raises(JobFailed, match="finished without running"):
        farm.result(jobs[1])


def _fake_launches(monkeypatch, before_spawn=lambda: None) -> list[subprocess.Popen]:
    """Popen in the farm stands in a 30 s sleep for torchrun (the farm's own options); returns the processes started."""
    real_popen, started = subprocess.Popen, []

    def fake_popen(cmd, **kwargs):
        before_spawn()
        started.append(real_popen(["sleep", "30"], **kwargs))
        return started[-1]

    monkeypatch.setattr(farm_mod.subprocess, "Popen", fake_popen)
    return started


def test_stop_just_before_the_launch_starts_starts_nothing(tmp_path, monkeypatch):
    """stop() lands after the driver's loop saw the farm running and before Popen (here: while the command is built):
    no launch starts at all (before, one started and was killed at once)."""
    farm = Farm(tmp_path, [program_job("selftest", 2)])
    real_cmd = farm_mod.torchrun_cmd

    def cmd_then_stop(world, program):
        farm.stop()
        return real_cmd(world, program)

    monkeypatch.setattr(farm_mod, "torchrun_cmd", cmd_then_stop)
    started = _fake_launches(monkeypatch)
    farm.run()
    assert started == [] and not farm.procs and not list(tmp_path.glob("launch-*.log"))


@pytest.mark.heavy
def test_stop_from_another_thread_while_a_launch_starts_returns_with_it_killed(tmp_path, monkeypatch):
    """The session's teardown calls stop() while the farm's thread is inside Popen: stop() returns only once that
    launch has started and been killed, so the interpreter cannot exit between (before, stop() returned at once and
    the launch registered later: a pytest exiting then left torchrun, in a session of its own, running)."""
    farm = Farm(tmp_path, [program_job("selftest", 2, timeout_s=120)])
    inside_popen, release, events = threading.Event(), threading.Event(), []

    def hold_popen():
        inside_popen.set()
        release.wait(5)

    started = _fake_launches(monkeypatch, before_spawn=hold_popen)
    driver = threading.Thread(target=farm.run, daemon=True)
    driver.start()
    assert inside_popen.wait(5)

    def stopper():
        farm.stop()
        events.append(("stop returned", len(started)))

    stopping = threading.Thread(target=stopper, daemon=True)
    stopping.start()
    stopping.join(0.3)  # stop() waits for the launch starting now (fixed) or returns at once (before)
    release.set()
    stopping.join(5)
    driver.join(10)
    assert not driver.is_alive() and not stopping.is_alive()
    assert len(started) == 1 and events == [("stop returned", 1)]  # the launch had started when stop() returned
    assert started[0].returncode == -signal.SIGKILL and not farm.procs  # killed by stop(): it would sleep 30 s


@pytest.mark.heavy
def test_stop_twice_and_from_two_threads_at_once_kills_the_launch_without_error(tmp_path, monkeypatch):
    farm = Farm(tmp_path, [program_job("selftest", 2, timeout_s=120)])
    started = _fake_launches(monkeypatch)
    driver = threading.Thread(target=farm.run, daemon=True)
    driver.start()
    deadline = time.monotonic() + 5
    while not farm.procs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert farm.procs
    errors: list[BaseException] = []

    def stop_catching():
        try:
            farm.stop()
        except BaseException as e:  # noqa: BLE001 -- the test's subject: stop() must not raise
            errors.append(e)

    stoppers = [threading.Thread(target=stop_catching) for _ in range(2)]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(5)
    farm.stop()  # a third time, the launch already killed (maybe reaped)
    driver.join(10)
    farm.stop()  # and once the driver has ended
    assert errors == [] and not driver.is_alive() and len(started) == 1
    assert started[0].returncode == -signal.SIGKILL and not psutil.pid_exists(started[0].pid)
    assert len(list(tmp_path.glob("launch-*.log"))) == 1
