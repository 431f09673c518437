"""Megatron's --overlap-moe-expert-parallel-comm (the stack setting ep_overlap): its combined 1F1B schedule hides the
EP all-to-alls of each steady-state step behind the other microbatch's compute (steptime/ep_overlap.py), holds one
more forward chunk in flight under pipelining, and is refused where Megatron-Core refuses it."""

from __future__ import annotations

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.parts import rank_parts
from backend.analytic.memory.pipeline_activations import in_flight
from backend.analytic.memory.stack_activations import stack_blocks
from backend.analytic.steptime.ep_overlap import steady_fraction
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.spec import ExperimentSpec
from backend.spec.run_rules import blocking_reasons

pytestmark = pytest.mark.unit

MOE = {"vocab_size": 4096, "d_model": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 4, "ffn_hidden": 2048,
       "seq_len": 2048, "n_experts": 8, "top_k": 2, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope",
       "bias": "none", "attention": "flash", "moe_grouped_gemm": True}
H100 = get_hardware("h100-sxm")


def _spec(ep_overlap: bool | None, parallel: dict | None = None, **train) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MOE,
        "train": {"global_batch": 32, "micro_batch": 1, "precision": "bf16-mixed", "stack": "megatron",
                  "ep_overlap": ep_overlap, **train},
        "parallel": parallel or {"strategy": "zero1", "world_size": 8, "ep": 8}})


def test_steady_share_follows_megatrons_warmup_count():
    """schedules.py get_pp_rank_microbatches: interleaved warmup (pp - k - 1) 2 + (v - 1) pp + 1 chunks of m v;
    without pipelining the first forward and the last backward run alone."""
    assert steady_fraction(_spec(True).parallel, 4, 0) == 3 / 4
    deep = ExperimentSpec.for_prediction({
        "model": {**MOE, "n_layers": 64}, "train": {"global_batch": 1024, "micro_batch": 1, "stack": "megatron",
                                                    "precision": "bf16-mixed",
                                                    "ep_overlap": True},
        "parallel": {"strategy": "zero1", "world_size": 64, "ep": 8, "pp": 8, "virtual_stages": 4,
                     "pp_schedule": "interleaved_1f1b"}}).parallel
    assert steady_fraction(deep, 128, 0) == (512 - (7 * 2 + 3 * 8 + 1)) / 512
    assert steady_fraction(deep, 128, 7) == (512 - (3 * 8 + 1)) / 512
    assert steady_fraction(deep, 2, 0) == 0.0  # every chunk in warmup: nothing overlaps


def test_steady_steps_hide_the_all_to_alls_their_compute_covers():
    """One node's all-to-alls are shorter than a microbatch's compute: every steady step hides them, so the exposed
    EP time is the off value times the share of microbatches outside the steady state (1 of 4: 32 / dp 8)."""
    off, on = (step_time(_spec(v), H100) for v in (False, True))
    ep_off = off.per_rank[0].exposed_by_dim_s["ep"]
    assert ep_off > 0
    assert on.per_rank[0].exposed_by_dim_s["ep"] == pytest.approx(ep_off / 4, rel=1e-9)
    assert on.summary["step_s"] == pytest.approx(off.summary["step_s"] - ep_off * 3 / 4, rel=1e-9)
    assert on.summary["compute_s"] == off.summary["compute_s"]


def test_the_stack_default_is_off_and_changes_nothing():
    assert step_time(_spec(None), H100).summary == step_time(_spec(False), H100).summary


def test_pipelined_ranks_hold_one_more_forward_chunk():
    """The extra warmup forward of the combined schedule (schedules.py 966-971) is held with the other chunks."""
    pipe = {"strategy": "zero1", "world_size": 16, "ep": 8, "pp": 2, "virtual_stages": 2,
            "pp_schedule": "interleaved_1f1b"}
    held = {}
    for v in (False, True):
        spec = _spec(v, pipe)
        layout = Layout.of(spec)
        parts = rank_parts(spec.model, layout, RankPosition.of_rank(spec, 0))
        held[v] = stack_blocks(spec.model, layout, 0, parts).held
    units = in_flight(Layout.of(_spec(False, pipe)), 0)  # the chunks rank 0 holds without the overlap
    assert held[True] * units == pytest.approx(held[False] * (units + 1), rel=1e-12)
    on, off = (estimate(_spec(v, pipe)).worst().activations_bytes for v in (True, False))
    assert on > off


@pytest.mark.parametrize("parallel, train, said", [
    ({"strategy": "zero1", "world_size": 8}, {}, "it needs ep > 1"),
    ({"strategy": "zero1", "world_size": 16, "ep": 8, "pp": 2}, {}, "needs virtual pipeline stages"),
    (None, {"recompute": "full"}, "Megatron-Core allows selective recompute only"),
    (None, {"precision": "fp32"}, "needs a bf16 or fp16 model"),
    (None, {"stack": "torchtitan"}, "set stack megatron"),
    (None, {"recompute": "selective", "recompute_modules": ["moe"]}, "refuses checkpointing the MoE layer"),
])
def test_refused_where_megatron_core_refuses_it(parallel, train, said):
    with pytest.raises(ValueError, match=said):
        _spec(True, parallel, **train)


def test_this_engine_predicts_it_only():
    reasons = blocking_reasons(_spec(True))
    assert any(r.startswith("ep_overlap=on") for r in reasons), reasons


def test_cli_and_megatron_importer_carry_it(capsys):
    from backend.cli import build_parser
    from backend.cli.spec_flags import spec_dict_from_args
    from backend.importers.megatron_fields import TABLE

    argv = ["estimate", "--stack", "megatron", "--overlap-moe-expert-parallel-comm"]
    args = build_parser("estimate").parse_args(argv)
    assert spec_dict_from_args(args)["train"]["ep_overlap"] is True
    assert TABLE["--overlap-moe-expert-parallel-comm"].name == "ep_overlap"


def test_a_planned_layout_megatron_refuses_keeps_its_all_to_alls_exposed():
    """The planner builds its layouts without validation (planner/space.light_spec): 1F1B under pp without virtual
    stages is timed and held as without the overlap, and says why."""
    from backend.planner.space import light_spec

    def planned(ep_overlap: bool):
        spec = _spec(False, {"strategy": "zero1", "world_size": 16, "ep": 8, "pp": 2,
                             "pp_schedule": "interleaved_1f1b", "virtual_stages": 2})
        data = spec.model_dump(mode="json")
        data["parallel"].update(pp_schedule="1f1b", virtual_stages=1)
        data["train"]["ep_overlap"] = ep_overlap
        return light_spec(data)

    on, off = step_time(planned(True), H100), step_time(planned(False), H100)
    assert on.summary["step_s"] == off.summary["step_s"]
    assert any("ep_overlap runs with virtual stages" in n for n in on.notes)
    assert estimate(planned(True)).worst().activations_bytes == estimate(planned(False)).worst().activations_bytes
