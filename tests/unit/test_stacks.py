"""Timeout diagnosis from faulthandler stack dumps (backend/runtime/protocol.py writes and reads them,
backend/launch/stacks.py diagnoses)."""

from backend.launch.stacks import hang_report
from backend.runtime.protocol import parse_dump, stack_path

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
