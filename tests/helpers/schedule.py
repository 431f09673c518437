"""The order in which `make test`'s one pytest-xdist run hands out the suite (`--dist loadgroup
--no-loadscope-reorder`: work units in collection order, each worker asks for the next when it is almost idle).

Two sizes of work unit:
- a test that needs one process and nothing else (`unit`, not `slow`, not `serial`) is a unit of its own;
- every other test is grouped with the others of its file, so a file's module fixtures (the SLURM cluster, a
  dashboard server) are set up once, on one worker, and its tests run in order.
The groups reach pytest-xdist's controller, which collects nothing itself, in a file the workers write at collection
(`GROUPS_ENV`): pytest-xdist 3.8's own `xdist_group` suffix is lost under pytest 9 (it sets `item._nodeid`, which
pytest 9 no longer reads), so `GroupScheduling` reads the groups from that file instead.

The groups go first: the files that wait on real components (an e2e test: SLURM's one-minute time limit, PostgreSQL
restarts, a browser left idle), the longest first (`slow` marks tests of tens of seconds), wait while the farm's ranks
and the other worker use the CPUs; in a file, the tests that read the farm come after the others. Then the other
groups, then the other files that read the farm (`farm.order_items`' order, so their jobs are done by then), and last
the unit tests, a test at a time (`heavy` ones first), which fill what is left evenly on both workers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

GROUPS_ENV = "SHARDLAB_TEST_GROUPS"
"""The file {test id: its group} that the workers write and the controller's scheduler reads."""

def one_by_one(item: pytest.Item) -> bool:
    """Whether a collected test (its kind mark set: tests/conftest.py) is a work unit of its own: `-m "unit and not
    slow and not serial"` (`make test-fast` leaves out the `heavy` ones too)."""
    return bool(item.get_closest_marker("unit")) and not item.get_closest_marker("slow") \
        and not item.get_closest_marker("serial")


SLOW_S = 20
"""A `slow` test's weight in seconds, against 1 for any other grouped test: a file's expected length."""


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def group_and_order(items: list[pytest.Item]) -> None:
    """Write the groups (every test that is not a unit of its own, by file), then sort `items` in place: waiting
    groups, other groups, farm readers, unit tests; a stable sort keeps each file's own order otherwise."""
    grouped = [i for i in items if not one_by_one(i)]
    if os.environ.get(GROUPS_ENV):
        _write_atomic(Path(os.environ[GROUPS_ENV]), {i.nodeid: _file(i) for i in grouped})
    size: Counter[str] = Counter()
    for item in grouped:
        size[_file(item)] += SLOW_S if item.get_closest_marker("slow") else 1
    waits = {_file(i) for i in grouped if i.get_closest_marker("e2e")}
    reads_farm = {_file(i) for i in grouped if i.get_closest_marker("farm")}
    first_seen = {f: n for n, f in reversed(list(enumerate(_file(i) for i in items)))}

    def key(item: pytest.Item) -> tuple[int, int, int, bool]:
        f, late = _file(item), item.get_closest_marker("farm") is not None
        if one_by_one(item):
            return (3, 0 if item.get_closest_marker("heavy") else 1, 0, False)
        if f in waits:
            return (0, -size[f], first_seen[f], late)
        if f in reads_farm:
            return (2, 0, first_seen[f], late)
        return (1, -size[f], first_seen[f], late)

    items.sort(key=key)


def _write_atomic(path: Path, groups: dict[str, str]) -> None:
    """Both workers write the same groups; each replaces the file whole, so the controller never reads half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, path)


def share_groups_with_workers(config: pytest.Config) -> None:
    """On the controller of a `--dist loadgroup` run: name the groups file (its workers inherit the variable) and
    schedule by it."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    folder = tempfile.mkdtemp(prefix="shardlab-groups-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[GROUPS_ENV] = str(Path(folder) / "groups.json")
    config.pluginmanager.register(_Scheduler(), "shardlab-schedule")


class GroupScheduling(LoadGroupScheduling):
    """pytest-xdist's loadgroup scheduling with the groups from `GROUPS_ENV` (a test not in it is its own group)."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
        return self._groups.get(nodeid, nodeid)


class _Scheduler:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: object) -> GroupScheduling:
        return GroupScheduling(config, log)
