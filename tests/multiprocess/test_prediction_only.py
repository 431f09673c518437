"""The torch limitation behind a prediction-only layout (issue 20 item 5), re-checked in ranks: the engine runs
zbv x FSDP2 anyway here and drifts from the single-process reference (the checks: tests/unit/test_prediction_only.py)."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from tests.helpers.mp_launch import TOL, run_specs

ZBV_PROBE = {"name": "zbv_fsdp_probe", "model": {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16},
             "train": {"global_batch": 8, "micro_batch": 1, "steps": 2, "warmup_steps": 0},
             "parallel": {"strategy": "fsdp", "world_size": 4, "pp": 2, "pp_schedule": "zbv", "virtual_stages": 2}}
DUALPIPEV_PROBE = {**ZBV_PROBE, "name": "dualpipev_fsdp_probe",
                   "parallel": {**ZBV_PROBE["parallel"], "pp_schedule": "dualpipev"}}


@pytest.mark.slow
def test_torch_still_drops_fsdp2_grads_under_split_backward(tmp_path):
    """The torch limitation behind the zbv/zero_bubble x FSDP2 rule (backend/spec/run_rules.py), re-checked on every
    torch upgrade: the engine runs the layout anyway here and its parameters drift from the single-process reference
    (torch 2.13: max |diff| 4.0e-3 after 2 steps; DualPipeV, the same split backward, likewise). When this test FAILS, torch has fixed it: remove that rule (one
    table, read by run_blockers and by the planner's run_blocked)."""
    results = run_specs(4, [ExperimentSpec.for_prediction(p) for p in (ZBV_PROBE, DUALPIPEV_PROBE)], tmp_path,
                        timeout_s=400)
    for name, schedule in (("zbv_fsdp_probe", "zbv"), ("dualpipev_fsdp_probe", "dualpipev (issue 35)")):
        result = results[name]
        assert result["param_max_abs_diff"] > 10 * TOL, (
            f"torch {__import__('torch').__version__} trains {schedule} x FSDP2 correctly now (max |diff| "
            f"{result['param_max_abs_diff']:.2g}): remove the split-backward x FSDP RunOnly")
