"""What a stack's framework can be told to run of the layout choices ShardLab models (spec/stacks.Repertoire):
Megatron-Core schedules 1F1B and interleaved 1F1B only and configures none / selective / full / block / uniform
recompute; torchtitan has no attention-core-only or Megatron-method recompute. The planner searches only those under
the stack; a spec asking for another is still predicted, with a note."""

from __future__ import annotations

import numpy as np

from backend.analytic.estimate import estimate
from backend.analytic.layout import SCHEDULE_NAMES
from backend.planner.space import enumerate_layouts
from backend.recompute_policy import KINDS
from backend.spec import ExperimentSpec, ModelSpec
from backend.spec.stack_rules import repertoire_notes
from backend.spec.stacks import STACKS

MODEL = {"vocab_size": 1024, "d_model": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 512,
         "seq_len": 512, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash"}


TWO_STAGES = ("interleaved_1f1b", "zbv", "dualpipev")


def _spec(stack: str, schedule: str, recompute: str) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MODEL, "parallel": {"strategy": "zero1", "dp": 2, "pp": 2, "pp_schedule": schedule,
                                     "virtual_stages": 2 if schedule in TWO_STAGES else 1},
        "train": {"global_batch": 8, "micro_batch": 1, "recompute": recompute, "stack": stack,
                  "precision": "bf16-mixed"}})


def test_a_spec_outside_its_stacks_repertoire_is_predicted_with_a_note():
    notes = repertoire_notes(_spec("megatron", "zbv", "op"))
    assert len(notes) == 2 and "pp_schedule 1f1b / interleaved_1f1b only, not zbv" in notes[0]
    assert "not op" in notes[1] and "get_forward_backward_func" in notes[1]
    assert repertoire_notes(_spec("megatron", "interleaved_1f1b", "block:2")) == []
    (note,) = repertoire_notes(_spec("torchtitan", "zbv", "selective"))
    assert "stack torchtitan configures recompute none / full / op / layers only, not selective" in note
    assert repertoire_notes(_spec("shardlab", "dualpipev", "selective")) == []
    assert any(n.startswith("stack megatron runs pp_schedule") for n in estimate(_spec("megatron", "gpipe",
                                                                                          "full")).notes)


def test_the_planner_searches_only_the_stacks_repertoire_and_keeps_a_held_policy():
    model = ModelSpec(**MODEL)
    every = enumerate_layouts(model, gpus=16, gpus_per_node=8, global_batch=32)
    r = STACKS["megatron"].layouts
    megatron = enumerate_layouts(model, gpus=16, gpus_per_node=8, global_batch=32, repertoire=r,
                                 extra_recompute=(("layers", 3),))
    names = {SCHEDULE_NAMES[int(s)] for s in np.unique(megatron.schedule)}
    kinds = {KINDS[int(k)] for k in np.unique(megatron.recompute)}
    assert names == {"1f1b", "interleaved_1f1b"}
    assert {SCHEDULE_NAMES[int(s)] for s in np.unique(every.schedule)} > names
    assert kinds == {"none", "selective", "full", "block", "layers"}  # layers: the held policy, kept
    assert 0 < len(megatron) < len(every)


def test_deepspeeds_pipeline_engine_runs_1f1b_or_dualpipev_under_zero_stage_1_at_most():
    """DeepSpeed 83fd8f87: PipelineEngine's TrainSchedule or DualPipeVSchedule, and its assert that ZeRO-2 / 3 do not
    combine with pipeline parallelism; without pp every ZeRO stage stays."""
    assert repertoire_notes(_spec("deepspeed", "dualpipev", "uniform:2")) == []
    (note,) = repertoire_notes(_spec("deepspeed", "interleaved_1f1b", "op"))
    assert "stack deepspeed runs pp_schedule 1f1b / dualpipev only, not interleaved_1f1b" in note
    zero3 = ExperimentSpec.for_prediction({
        "model": MODEL, "parallel": {"strategy": "zero3", "dp": 2, "pp": 2},
        "train": {"global_batch": 8, "micro_batch": 1, "stack": "deepspeed", "precision": "bf16-mixed"}})
    (note,) = repertoire_notes(zero3)
    assert "ZeRO stage <= 1 only, not zero3 (ZeRO stage 3) with pp 2" in note and "incompatible" in note
    assert repertoire_notes(zero3.model_copy(update={"train": zero3.train.model_copy(update={"stack": "shardlab"})})) \
        == []
    model = ModelSpec(**MODEL)
    every = enumerate_layouts(model, gpus=16, gpus_per_node=8, global_batch=32)
    ds = enumerate_layouts(model, gpus=16, gpus_per_node=8, global_batch=32, repertoire=STACKS["deepspeed"].layouts)
    piped = np.asarray(ds.pp) > 1
    assert piped.any() and (~piped).any()
    assert {SCHEDULE_NAMES[int(s)] for s in np.unique(np.asarray(ds.schedule)[piped])} == {"1f1b", "dualpipev"}
    assert set(np.unique(np.asarray(ds.zero_stage)[piped]).tolist()) == {0, 1}
    assert set(np.unique(np.asarray(ds.zero_stage)[~piped]).tolist()) == {0, 1, 2, 3}
    assert {KINDS[int(k)] for k in np.unique(ds.recompute)} == {KINDS[int(k)] for k in np.unique(every.recompute)}
