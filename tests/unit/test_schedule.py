"""The suite's own schedule (tests/helpers/schedule.py): which tests are grouped by file, in what order the run hands
them out, and that pytest-xdist's controller reads the same groups the workers wrote."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import schedule


class FakeItem:
    """A collected test: its id and its marks (kind, slow, serial, heavy, farm, e2e)."""

    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid, self.marks = nodeid, set(marks)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def _items() -> list[FakeItem]:
    return [
        FakeItem("tests/unit/test_a.py::test_fast", "unit"),
        FakeItem("tests/unit/test_a.py::test_sweep", "unit", "heavy"),
        FakeItem("tests/unit/test_a.py::test_real_run", "unit", "slow"),
        FakeItem("tests/multiprocess/test_b.py::test_ranks", "multiprocess", "farm"),
        FakeItem("tests/e2e/test_c.py::test_local_twin", "multiprocess", "slow", "farm"),
        FakeItem("tests/e2e/test_c.py::test_time_limit", "e2e", "slow"),
        FakeItem("tests/unit/test_d.py::test_launch", "unit", "serial"),
        FakeItem("tests/unit/test_d.py::test_more", "unit", "serial"),
        FakeItem("tests/e2e/test_e.py::test_page", "e2e"),
    ]


def test_waiting_files_first_longest_first_then_other_groups_farm_readers_and_unit_tests(tmp_path, monkeypatch):
    monkeypatch.setenv(schedule.GROUPS_ENV, str(tmp_path / "groups.json"))
    items = _items()
    schedule.group_and_order(items)
    assert [i.nodeid.split("/")[-1] for i in items] == [
        "test_c.py::test_time_limit", "test_c.py::test_local_twin",  # waits, slow; its farm reader after the rest
        "test_e.py::test_page",  # waits
        "test_a.py::test_real_run",  # other groups, longest (slow) first
        "test_d.py::test_launch", "test_d.py::test_more",
        "test_b.py::test_ranks",  # reads the farm
        "test_a.py::test_sweep", "test_a.py::test_fast",  # one by one, heavy first
    ]
    groups = json.loads((tmp_path / "groups.json").read_text())
    assert groups == {i.nodeid: i.nodeid.split("::")[0] for i in items if not schedule.one_by_one(i)}
    assert "tests/unit/test_a.py::test_fast" not in groups and "tests/unit/test_a.py::test_sweep" not in groups


def test_the_controller_hands_out_a_file_as_one_unit_and_a_unit_test_alone(tmp_path, monkeypatch):
    path = tmp_path / "groups.json"
    path.write_text(json.dumps({"tests/e2e/test_c.py::test_time_limit": "tests/e2e/test_c.py"}))
    monkeypatch.setenv(schedule.GROUPS_ENV, str(path))
    scheduling = schedule.GroupScheduling.__new__(schedule.GroupScheduling)  # _split_scope needs no set-up
    assert scheduling._split_scope("tests/e2e/test_c.py::test_time_limit") == "tests/e2e/test_c.py"
    assert scheduling._split_scope("tests/unit/test_a.py::test_fast") == "tests/unit/test_a.py::test_fast"


@pytest.mark.parametrize("dist, is_worker, shares", [("loadgroup", False, True), ("load", False, False),
                                                      ("loadgroup", True, False)])
def test_only_the_controller_of_a_loadgroup_run_names_the_groups_file(monkeypatch, dist, is_worker, shares):
    monkeypatch.delenv(schedule.GROUPS_ENV, raising=False)
    registered, cleanups = [], []

    class Config:
        pluginmanager = type("PM", (), {"register": lambda self, plugin, name: registered.append(name)})()

        def getoption(self, name, default=None):
            return dist

        def add_cleanup(self, fn):
            cleanups.append(fn)

    config = Config()
    if is_worker:
        config.workerinput = {}
    schedule.share_groups_with_workers(config)
    assert (schedule.GROUPS_ENV in os.environ) is shares and bool(registered) is shares
    for fn in cleanups:
        fn()
