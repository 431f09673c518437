"""Issue 35: the MoE training settings in the spec (capacity, padding, aux loss, dispatcher, grouped GEMM) and the
DualPipeV schedule: bounds, the checks with their arithmetic, the CLI flags."""

from __future__ import annotations

import argparse

import pytest

from backend.cli.spec_flags import add_spec_flags, spec_from_args
from backend.spec import ExperimentSpec, validate_spec

MOE = {"n_experts": 4, "top_k": 2}


def test_capacity_fields_default_to_megatrons_dropless_alltoall():
    m = ExperimentSpec.model_validate({"model": MOE}).model
    assert (m.capacity_factor, m.moe_pad_to_capacity, m.moe_aux_loss_coeff, str(m.moe_dispatcher), m.moe_grouped_gemm) \
        == (None, False, 0.0, "alltoall", False)


@pytest.mark.parametrize(("model", "needle"), [
    (MOE | {"moe_pad_to_capacity": True}, "moe_pad_to_capacity pads every expert's input to its capacity: it needs "
                                           "capacity_factor (got None = dropless)"),
    ({"capacity_factor": 1.0}, "capacity_factor=1.0 needs a MoE model (n_experts > 0, got n_experts=0)"),
    ({"moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff=0.01 needs a MoE model"),
    ({"moe_dispatcher": "allgather"}, "moe_dispatcher=allgather needs a MoE model"),
    ({"moe_grouped_gemm": True}, "moe_grouped_gemm=True needs a MoE model"),
])
def test_capacity_settings_checked_with_the_reason(model, needle):
    spec, problems = validate_spec({"model": model})
    assert spec is None and any(needle in p for p in problems), problems


@pytest.mark.parametrize("bad", [0, -1.0])
def test_capacity_factor_is_positive(bad):
    spec, problems = validate_spec({"model": MOE | {"capacity_factor": bad}})
    assert spec is None and any("capacity_factor" in p for p in problems), problems


def test_dualpipev_needs_two_stages_per_rank_and_two_microbatches_per_rank():
    base = {"model": {"n_layers": 4}, "parallel": {"world_size": 2, "pp": 2, "pp_schedule": "dualpipev",
                                                    "virtual_stages": 2}}
    _, problems = validate_spec(base | {"train": {"global_batch": 6, "micro_batch": 2}})
    assert problems == ["dualpipev needs microbatches >= pp * virtual_stages = 2 * 2 = 4 stages (got microbatches=3)"]
    spec, problems = validate_spec(base | {"train": {"global_batch": 10, "micro_batch": 2}})
    assert problems == [] and spec.train.microbatches == 5  # torch's DualPipeV does not need pp | microbatches
    _, problems = validate_spec({**base, "parallel": base["parallel"] | {"virtual_stages": 3},
                                 "train": {"global_batch": 12, "micro_batch": 2}})
    assert any("dualpipev runs exactly 2 stages per rank (got virtual_stages=3)" in p for p in problems), problems


def test_cli_flags_set_the_moe_fields():
    ap = argparse.ArgumentParser()
    add_spec_flags(ap)
    args = ap.parse_args(["--experts", "4", "--capacity-factor", "1.25", "--moe-pad-to-capacity",
                          "--moe-aux-loss-coeff", "0.01", "--moe-dispatcher", "allgather", "--moe-grouped-gemm",
                          "--schedule", "dualpipev"])
    spec, problems = spec_from_args(args, predict_only=True)
    assert problems == []
    data = spec.model
    assert (data.capacity_factor, data.moe_pad_to_capacity, data.moe_aux_loss_coeff,
                                 str(data.moe_dispatcher), data.moe_grouped_gemm) == (1.25, True, 0.01, "allgather",
                                                                                      True)
