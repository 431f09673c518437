"""Pipeline schedules: the stage split rules (one process), and at world 2 (gpipe, 1f1b, interleaved, zero-bubble,
zbv) loss/parameter parity with the single-process reference and a timeline with every microbatch's passes (the
farm's ranks)."""

import pytest

from backend.analytic.measured.bubble_measure import measured_bubble_fraction
from backend.spec import Schedule
from backend.strategies.pp import stage_layers, stages_of_rank
from tests.helpers.farm import assert_parity, params, parity_job
from tests.helpers.specs import tiny


def test_stage_split_gives_earlier_stages_the_extra_layer():
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(7, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert stage_layers(4, 4) == [[0], [1], [2], [3]]


def test_stage_placement():
    assert stages_of_rank(0, 4, 2, Schedule.INTERLEAVED_1F1B) == [0, 4]
    assert stages_of_rank(1, 4, 2, Schedule.ZBV) == [1, 6]
    assert stages_of_rank(3, 4, 1, Schedule.ONE_F_ONE_B) == [3]


L4 = {"n_layers": 4}
SPECS = {s.name: s for s in [
    tiny("gpipe", strategy="pp", world_size=2, pp_schedule="gpipe"),
    tiny("1f1b", model={"n_layers": 3}, strategy="pp", world_size=2),
    tiny("interleaved", model=L4, strategy="pp", world_size=2, pp_schedule="interleaved_1f1b", virtual_stages=2),
    tiny("zero_bubble", model=L4, strategy="pp", world_size=2, pp_schedule="zero_bubble", virtual_stages=2),
    tiny("zbv", model=L4, strategy="pp", world_size=2, pp_schedule="zbv", virtual_stages=2),
]}
PARITY = {name: parity_job(s) for name, s in SPECS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(PARITY))
def test_pp_parity_and_timeline(farm, name):
    spec, r = SPECS[name], farm.result(PARITY[name])
    assert_parity(r)
    p = spec.parallel
    m = spec.train.microbatches
    compute = [e for e in r["timeline"] if e["pass"] in ("F", "B", "W")]
    stages = p.pp * p.virtual_stages
    fwd = {(e["stage"], e["microbatch"]) for e in compute if e["pass"] == "F"}
    assert fwd == {(s, i) for s in range(stages) for i in range(m)}
    assert {(e["stage"], e["microbatch"]) for e in compute if e["pass"] == "B"} == fwd
    if spec.parallel.pp_schedule in (Schedule.ZERO_BUBBLE, Schedule.ZBV):
        assert any(e["pass"] == "W" for e in compute)
    for e in compute:
        assert e["end_s"] >= e["start_s"] >= -1e-3
        assert e["rank"] == stages_of_rank_owner(spec, e["stage"])
    assert 0.0 < measured_bubble_fraction(r["timeline"]) < 1.0


def stages_of_rank_owner(spec, stage):
    p = spec.parallel
    return next(r for r in range(p.pp) if stage in stages_of_rank(r, p.pp, p.virtual_stages, p.pp_schedule))
