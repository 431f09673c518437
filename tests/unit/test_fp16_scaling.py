"""fp16 loss scaling in the result and on the run page: the note, the field, skipped steps shown for fp16 only."""

from __future__ import annotations

from tests.helpers.mp_launch import tiny

FP16 = {"precision": "fp16-mixed"}


def test_loss_scaling_note_and_field():
    from backend.engine.assemble import _loss_scaling

    rep = {"skipped_steps": [1], "steps": 5, "scale": 32768.0}
    skipped, notes = _loss_scaling([{"extra": {"loss_scaling": rep}}, {"extra": {"loss_scaling": rep}}])
    assert skipped == [1] and "1 of 5 optimizer steps skipped" in notes[0] and len(notes) == 1
    _, notes = _loss_scaling([{"extra": {"loss_scaling": rep}}, {"extra": {"loss_scaling": rep | {"skipped_steps": []}}}])
    assert "DISAGREES" in notes[-1]
    assert _loss_scaling([{"extra": {}}]) == (None, [])


def test_run_page_headline_shows_skipped_steps_for_fp16_only():
    from backend.result import RunResult, Status
    from dashboard import detail_view as dv

    fp16 = RunResult(status=Status.OK, spec=tiny("h", strategy="ddp", world_size=2, train=FP16),
                     loss_scaling_skipped_steps=[0, 3])
    assert dv.headline(fp16)["fp16 steps skipped (overflow)"] == "2 [0, 3]"
    assert "MFU" in list(dv.headline(fp16))[-1]  # the metric is added, nothing displaced
    plain = RunResult(status=Status.OK, spec=tiny("h", strategy="ddp", world_size=2))
    assert "fp16 steps skipped (overflow)" not in dv.headline(plain)
    assert RunResult.from_json(fp16.to_json()).loss_scaling_skipped_steps == [0, 3]  # stored with the run
