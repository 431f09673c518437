"""benchmarks/suite_budget.py: the budget of a pytest run from /proc samples and the per-test timeline."""

from __future__ import annotations

import os

from benchmarks.suite_budget import (
    MAKE_TEST_ARGS,
    ROOT,
    TICK_S,
    Sample,
    Span,
    budget,
    category_of,
    read_sample,
    summary_lines,
)
from benchmarks.suite_timeline import span_record

NAMES = {1: "/process_api --init", 10: "python -u -m tests.helpers.farm_rank plan.json",
         11: "python -m torch.distributed.run --standalone -m backend.engine.rank --spec s.json", 12: ""}


def ticks(cpu_s: float) -> int:
    return round(cpu_s / TICK_S)


def test_each_process_counts_from_the_first_sample_or_from_its_start_and_the_rest_is_unsampled():
    samples = [Sample(100.0, ticks(50), ticks(400), {1: 40.0, 10: 5.0}),
               Sample(130.0, ticks(100), ticks(460), {1: 41.0, 10: 30.0, 11: 3.0}),
               Sample(160.0, ticks(150), ticks(520), {1: 42.0, 12: 0.5})]
    spans = [Span("t.py::a", "gw0", 101.0, 131.0, 2.0, 1.0), Span("t.py::b", "gw1", 131.0, 132.0, 4.0, 0.0)]
    b = budget(samples, NAMES, spans, cores=2)
    assert b["wall_s"] == 60.0 and b["busy_cpu_s"] == 100.0 and b["floor_s"] == 50.0
    assert b["busy_fraction"] == round(100 / 120, 3)
    # process_api ran before sampling began: only its 2 s during the run count; pid 11 started during it
    assert b["by_category"] == {"farm ranks": 25.0, "torchrun launchers": 3.0, "other": 2.0,
                                "kernel threads and unnamed": 0.5}
    assert b["unsampled_cpu_s"] == 100.0 - 30.5
    assert [w["from_s"] for w in b["windows"]] == [0.0, 30.0] and b["windows"][1]["busy_fraction"] == round(50 / 60, 3)
    assert [r["id"] for r in b["longest_tests"]] == ["t.py::a", "t.py::b"]
    assert [r["id"] for r in b["cpu_heaviest_tests"]] == ["t.py::b", "t.py::a"]
    assert b["tests_self_cpu_s"] == 6.0
    assert "packed perfectly, the same work takes 50 s" in summary_lines(b)[0]


def test_a_command_line_names_its_category_first_match_first():
    assert category_of("python -m torch.distributed.run -m tests.helpers.farm_rank p.json") == "farm ranks"
    assert category_of("python -m backend worker --db x") == "workers (python -m backend worker)"
    assert category_of("python -m backend estimate") == "other backend processes"
    assert category_of("") == "kernel threads and unnamed"


def test_a_sample_of_this_host_sees_this_process_and_names_it():
    names: dict[int, str] = {}
    s = read_sample(names)
    assert s.total_ticks >= s.busy_ticks > 0
    assert s.cpu_s[os.getpid()] > 0 and "python" in names[os.getpid()]


def test_a_tests_line_has_its_own_and_its_childrens_cpu():
    before = os.times()
    after = os.times_result((before.user + 1.5, before.system + 0.5, before.children_user + 2.0,
                             before.children_system, before.elapsed))
    rec = span_record("t.py::a", 10.0, 12.5, before, after)
    assert rec["id"] == "t.py::a" and rec["start"] == 10.0 and rec["end"] == 12.5
    assert abs(rec["self_cpu_s"] - 2.0) < 1e-9 and abs(rec["children_cpu_s"] - 2.0) < 1e-9


def test_the_default_run_is_make_tests():
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in x and "--dist" in x)
    assert " ".join(MAKE_TEST_ARGS) in line
