"""A pytest plugin for benchmarks/suite_budget.py: one JSON line per test, appended to the file `TIMELINE_ENV` names
(each xdist worker appends its own): its id, worker, start and end (epoch seconds), and the CPU seconds the test's
process spent on it (`self_cpu_s`) and its reaped children (`children_cpu_s`: a child reaped during this test, even
one that an earlier test or the farm's thread started, is counted here). Off unless the variable is set.

`python -m pytest -p benchmarks.suite_timeline ...` loads it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

TIMELINE_ENV = "SHARDLAB_SUITE_TIMELINE"


def span_record(nodeid: str, start: float, end: float, before: os.times_result, after: os.times_result) -> dict:
    """One test's line."""
    return {"id": nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start, "end": end,
            "self_cpu_s": (after.user + after.system) - (before.user + before.system),
            "children_cpu_s": (after.children_user + after.children_system)
            - (before.children_user + before.children_system)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get(TIMELINE_ENV)
    start, before = time.time(), os.times()
    yield
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(span_record(item.nodeid, start, time.time(), before, os.times())) + "\n")
