"""steptime/schedule_levels.py: GPipe and 1F1B action plans from a closed form of their levels (issue 30 item 5: the
round-robin over ranks cost ~0.1 s per (p, m) at pp 32 with 1,024 microbatches, cold, in every MoE plan). The closed
form must pass its own dependency check everywhere (a None would fall back silently), and the makespans must equal
the event simulation's bit for bit (tests/unit/test_steptime_schedule.py's reference) at pipeline sizes the
planner re-times, beyond that file's grid."""

from __future__ import annotations

import random

import pytest

from backend.analytic.steptime.schedule import makespan, makespan_pair
from backend.analytic.steptime.schedule_levels import levelled_plan
from tests.unit.test_steptime_schedule import reference_makespan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_levelled_plan_passes_its_check(schedule):
    for p in (1, 2, 3, 4, 5, 7, 8, 16, 32, 61):
        for m in (1, 2, 3, 4, 5, 8, 15, 16, 31, 32, 64, 100):
            plan = levelled_plan(schedule, p, m)
            assert plan is not None and all(len(column) == 2 * p * m for column in plan)
            assert all(dep < i and own < i for i, (_, _, _, dep, own, _) in enumerate(zip(*plan, strict=False)))


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 16, 64), ("1f1b", 32, 40), ("1f1b", 32, 100), ("gpipe", 16, 33),
                                          ("1f1b", 13, 7), ("gpipe", 32, 5)])
def test_levelled_makespan_equals_reference(schedule, p, m):
    rng = random.Random(p * 1009 + m)
    fwd = [rng.uniform(0.1, 3.0) for _ in range(p)]
    bwd = [rng.uniform(0.2, 6.0) for _ in range(p)]
    for hop in (0.0, 0.37, rng.uniform(0.0, 2.0)):
        ref = reference_makespan(schedule, p=p, v=1, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=hop)
        assert makespan(schedule, p=p, v=1, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=hop) == ref
        no_hop = reference_makespan(schedule, p=p, v=1, m=m, fwd_s=fwd, bwd_s=bwd)
        assert makespan_pair(schedule, p=p, v=1, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=hop) == (*no_hop, ref[0])
