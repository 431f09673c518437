"""Timeout diagnosis from faulthandler stack dumps (backend/runtime/protocol.py writes and reads them,
backend/launch/stacks.py diagnoses), and a real dump of another process read back (multiprocess)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.launch.stacks import hang_report
from backend.runtime.protocol import parse_dump, progress_mark_path, stack_path

SITE = "/venv/lib/python3.11/site-packages"
WAITING = f'''Thread 0x00007f01 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 4810 in barrier
  File "/repo/backend/bench/timing.py", line 20 in fence
  File "/repo/backend/engine/rank.py", line 99 in <module>

Current thread 0x00007f02 (most recent call first):
  <no Python frame>
'''
SLEEPING = '''Current thread 0x00007f03 (most recent call first):
  File "/repo/backend/launch/faults.py", line 37 in maybe_inject
  File "/repo/backend/engine/loop.py", line 40 in run_loop
'''


def test_parse_dump_reads_each_thread_innermost_first():
    threads = parse_dump(WAITING)
    assert threads[0][0] == (f"{SITE}/torch/distributed/distributed_c10d.py", 4810, "barrier")
    assert threads[1] == []


def test_the_rank_outside_torch_is_named(tmp_path):
    stack_path(tmp_path, 0).write_text(WAITING)
    stack_path(tmp_path, 1).write_text(SLEEPING)
    text, culprit = hang_report(tmp_path)
    assert culprit == 1
    assert "rank 1 outside torch at backend/launch/faults.py:37 in maybe_inject" in text
    assert "rank 0 inside torch (barrier) called from backend/bench/timing.py:20 in fence" in text


def test_no_culprit_when_every_rank_waits(tmp_path):
    stack_path(tmp_path, 0).write_text(WAITING)
    stack_path(tmp_path, 1).write_text(WAITING)
    text, culprit = hang_report(tmp_path)
    assert culprit is None and text.count("inside torch") == 2
    assert hang_report(tmp_path / "missing") is None


def test_a_rank_that_gives_no_stack_while_its_peers_wait_is_named(tmp_path):
    """Issue 31: a rank frozen by SIGSTOP (or stuck in the kernel) cannot dump its stack; its peers wait in torch."""
    stack_path(tmp_path, 0).write_text(WAITING)
    stack_path(tmp_path, 1).write_text("")  # registered at start, never answered
    text, culprit = hang_report(tmp_path)
    assert culprit == 1 and "rank 1 is holding the job up (did not answer the stack-dump signal" in text
    assert "rank 1 gave no stack" in text


def test_a_rank_that_finished_is_not_blamed_for_giving_no_stack(tmp_path):
    stack_path(tmp_path, 0).write_text(SLEEPING)
    stack_path(tmp_path, 1).write_text("")
    progress_mark_path(tmp_path, 0).write_text("14 comm 3/3\n")
    progress_mark_path(tmp_path, 1).write_text("14 finished\n")
    text, culprit = hang_report(tmp_path)
    assert culprit is None and "rank 1 gave no stack" not in text


def test_the_rank_that_stopped_making_progress_first_is_named(tmp_path):
    for r in (0, 1, 2):
        stack_path(tmp_path, r).write_text(WAITING)
    for r, done in ((0, 5), (1, 3), (2, 5)):
        progress_mark_path(tmp_path, r).write_text(f"{done} timed {done - 1}/10\n")
    text, culprit = hang_report(tmp_path)
    assert culprit == 1 and "stopped making progress first" in text
    assert "steps finished: rank 0 5 (timed 4/10), rank 1 3 (timed 2/10), rank 2 5 (timed 4/10)" in text
    progress_mark_path(tmp_path, 2).write_text("3 timed 2/10\n")  # two ranks behind alike: no single culprit
    assert hang_report(tmp_path)[1] is None


def test_progress_marks_are_written_in_place_and_read_back(tmp_path, monkeypatch):
    from backend.runtime import protocol

    monkeypatch.setattr(protocol, "_MARK", [])
    protocol.mark_progress("timed", 1, 2)  # not enabled: nothing happens
    protocol.enable_progress_marks(tmp_path, 3)
    for step in (1, 2):
        protocol.mark_progress("timed", step, 2)
    assert protocol.read_progress_marks(tmp_path)[3] == protocol.RankProgress(3, 2, "timed 2/2", False)
    protocol.mark_finished()
    assert protocol.read_progress_marks(tmp_path)[3].finished
    assert len(progress_mark_path(tmp_path, 3).read_bytes()) == protocol.MARK_BYTES
    import os
    os.close(protocol._MARK[0])


# ---- in processes of their own ----------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_faulthandler_dump_round_trips(tmp_path):
    """A real process registered with enable_stack_dump writes a dump parse_dump understands."""
    code = ("import time\n"
            "from backend.runtime.protocol import enable_stack_dump\n"
            f"enable_stack_dump({str(tmp_path)!r}, 3)\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGUSR1)
        for _ in range(50):  # faulthandler writes from the signal handler, asynchronously
            if "<module>" in stack_path(tmp_path, 3).read_text():
                break
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    threads = parse_dump(stack_path(tmp_path, 3).read_text())
    assert any(f[2] == "<module>" for t in threads for f in t)
