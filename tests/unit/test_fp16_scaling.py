"""fp16-mixed loss scaling (strategies/scaler.py, wired into strategies/step.py and pp.py): in the result and on the run
page (the note, the field, skipped steps shown for fp16 only); in the farm's ranks, parity with the single-process
reference (which scales the same way) and one skip agreed by every rank."""

from __future__ import annotations

import pytest
import torch

from backend.engine.accuracy_notes import PARITY_BOUND
from tests.helpers.farm import engine_job, fp16_inject_job, params, uses
from tests.helpers.specs import tiny

FP16 = {"precision": "fp16-mixed"}


def test_loss_scaling_note_and_field():
    from backend.engine.assemble import _loss_scaling

    rep = {"skipped_steps": [1], "steps": 5, "scale": 32768.0}
    skipped, notes = _loss_scaling([{"extra": {"loss_scaling": rep}}, {"extra": {"loss_scaling": rep}}])
    assert skipped == [1] and "1 of 5 optimizer steps skipped" in notes[0] and len(notes) == 1
    _, notes = _loss_scaling([{"extra": {"loss_scaling": rep}},
                              {"extra": {"loss_scaling": rep | {"skipped_steps": []}}}])
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


# ---- in ranks (the farm) ----------------------------------------------------------------------------------------

TRAIN = FP16 | {"warmup_steps": 1}
RUNS = [engine_job(tiny("fp16_ddp", strategy="ddp", world_size=2, train=TRAIN)),
        engine_job(tiny("fp16_zero3", strategy="zero3", world_size=2, train=TRAIN)),
        engine_job(tiny("fp16_tp", strategy="tp", world_size=2, train=TRAIN)),
        engine_job(tiny("fp16_pp", strategy="pp", world_size=2, pp_schedule="1f1b", train=TRAIN))]


@pytest.mark.slow
@uses(*RUNS)
def test_fp16_world2_matches_the_scaled_reference(farm):
    """ddp, zero3, tp and pp (1f1b) at world 2 under fp16-mixed: every rank steps through the loss scaler
    (its report covers every engine step), the losses are the unscaled ones and match the reference at the
    fp16 parity bound (engine/notes.PARITY_BOUND)."""
    for job in RUNS:
        run = farm.result(job)
        res, ranks, s = run["result"], run["ranks"], run["result"].spec
        assert len(res.loss_reference) == len(res.loss) == 3
        torch.testing.assert_close(res.loss, res.loss_reference, atol=PARITY_BOUND["fp16-mixed"], rtol=0, msg=s.name)
        assert 3.5 < res.loss[0] < 5.0, (s.name, res.loss)  # ln(64) ≈ 4.16: unscaled, not x 65536
        n_steps = len(res.loss) + 1 + min(3, s.train.steps)  # warm-up + timed, memory step, comm-timing steps
        for r in ranks:
            assert r["extra"]["loss_scaling"]["steps"] == n_steps, (s.name, r["extra"])
        assert res.loss_scaling_skipped_steps == ranks[0]["extra"]["loss_scaling"]["skipped_steps"]
        assert any(n.startswith("fp16 loss scaling") for n in res.notes)


INJECT = {p["strategy"]: fp16_inject_job(tiny(f"inject_{p['strategy']}", train=FP16, **p))
          for p in [dict(strategy="tp", world_size=2), dict(strategy="zero3", world_size=2),
                    dict(strategy="pp", world_size=2, pp_schedule="1f1b")]}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", params(INJECT))
def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank(farm, strategy):
    """+inf in rank 1's local gradient at step 1 (tp: a DTensor shard; zero3: an FSDP2 shard; pp: the last stage's
    grads, rank 0 holding the first stage): every rank skips step 1 and only step 1 (tests/helpers/fp16_inject.py)."""
    res = farm.result(INJECT[strategy])
    for r in res["per_rank"]:
        assert r["skipped"] == [1], r
        assert r["params_changed"] == [True, False, True], r  # step 1 left every local shard unchanged
        assert r["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15], r  # halved once, by the skip
        assert r["report"]["skipped_steps"] == [1] and r["report"]["steps"] == 3
