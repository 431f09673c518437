"""Pipeline schedules at world 2 (gpipe, 1f1b, interleaved, zero-bubble, zbv): loss/parameter parity with the
single-process reference and a timeline with every microbatch's passes; the stage split rules."""

from backend.spec import Schedule
from backend.strategies.pp import stage_layers, stages_of_rank


def test_stage_split_gives_earlier_stages_the_extra_layer():
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(7, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert stage_layers(4, 4) == [[0], [1], [2], [3]]


def test_stage_placement():
    assert stages_of_rank(0, 4, 2, Schedule.INTERLEAVED_1F1B) == [0, 4]
    assert stages_of_rank(1, 4, 2, Schedule.ZBV) == [1, 6]
    assert stages_of_rank(3, 4, 1, Schedule.ONE_F_ONE_B) == [3]
