"""This engine's compiled cross-entropy in the memory model (stack shardlab, `loss_compiled`): the loss keeps the 16-bit
logits and two fp32 values per row, as the compiled loss measures (tests/helpers/compiled_loss_memory.py: 2, 2, 4 B
per logit against eager's 10, 4, 12), in estimate and in the planner alike."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.layout import Layout
from backend.analytic.memory.activations import FUSED_LOSS_ROW_BYTES
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.planner.held import HeldTraining
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

MODEL = {"vocab_size": 8192, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 256, "bias": "none"}
"""No biases: autocast caches no bias casts, so the forward + loss moment stays the activation peak."""
MEASURED_EAGER, MEASURED_COMPILED = (10, 4, 12), (2, 2, 4)
"""Bytes per logit at the loss's forward peak, kept after it, at its backward peak: the helper's readings, which
test_stack_memory.test_the_compiled_losss_bytes_per_logit_are_what_inductor_allocates asserts on a fresh process."""


def _spec(train: dict, parallel: dict | None = None) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MODEL, "train": {"global_batch": 4, "micro_batch": 2, "precision": "bf16-mixed", **train},
        "parallel": parallel or {"strategy": "zero3", "world_size": 2}, "runtime": {"device": "cpu"}})


def test_only_this_engines_own_compiled_loss_sets_the_layout_flag():
    assert Layout.of(_spec({"loss_compiled": True})).loss_compiled
    assert not Layout.of(_spec({})).loss_compiled
    tp = {"strategy": "tp", "world_size": 2, "tp": 2, "sequence_parallel": True}
    assert not Layout.of(_spec({"loss_compiled": True, "loss_parallel": True}, tp)).loss_compiled
    assert Layout.of(_spec({"loss_compiled": True, "loss_parallel": False}, tp)).loss_compiled
    titan = Layout.of(_spec({"stack": "torchtitan", "loss_compiled": True}))
    assert not titan.loss_compiled and titan.stack.loss_compiled  # stack_activations.head_bytes' terms


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_the_compiled_loss_saves_what_the_measured_one_does(strategy):
    """Compiled minus eager at the loss's forward peak and at its backward peak is the measured difference per logit
    (8 and 8 B), whether or not the training loop still holds the logits (ddp holds them, zero3 lets them go)."""
    parallel = {"strategy": strategy, "world_size": 2}
    eager, compiled = (estimate(_spec({"loss_compiled": on}, parallel)).worst().moments() for on in (False, True))
    rows = 2 * MODEL["seq_len"]
    logits = rows * MODEL["vocab_size"]
    forward_gap = MEASURED_EAGER[0] - MEASURED_COMPILED[0]
    backward_gap = MEASURED_EAGER[2] - MEASURED_COMPILED[2]
    row_stats = rows * FUSED_LOSS_ROW_BYTES  # the compiled loss's max and log-sum-exp per row
    assert eager["activation_peak"] - compiled["activation_peak"] == forward_gap * logits - row_stats
    held = 0 if strategy == "zero3" else 2 * logits  # eager: the loop's logits beside the loss's, at backward
    assert eager["loss_backward"] - compiled["loss_backward"] == backward_gap * logits + held - row_stats


def test_the_planner_prices_a_compiled_loss_as_estimate_does():
    """One model called by everything: the planner's worst-rank bytes with the held compiled loss equal
    worst_rank_bytes on each planned spec alone."""
    spec = _spec({"loss_compiled": True, "micro_batch": 1}, {"strategy": "ddp", "world_size": 4})
    held = HeldTraining.of_train(spec.train.model_dump(mode="json"))
    assert held.engine_compile().loss and not held.engine_compile().blocks
    layouts = enumerate_layouts(spec.model, gpus=4, gpus_per_node=4, global_batch=4, precision="bf16-mixed",
                                compiled=held.engine_compile())
    memory, _ = worst_rank_memory(spec.model, layouts)
    eager, _ = worst_rank_memory(spec.model, replace(layouts, compiled=replace(layouts.compiled, loss=False)))
    assert (memory < eager).all()
    for i in range(0, len(layouts), max(1, len(layouts) // 20)):
        data = layouts.take(i).spec_dict(spec.model)
        data["train"]["loss_compiled"] = True
        one = light_spec(data)
        assert Layout.of(one).loss_compiled == (not (one.parallel.tp > 1 and one.train.loss_parallel))
        if Layout.of(one).loss_compiled:
            assert worst_rank_bytes(one)[0] == pytest.approx(memory[i], rel=1e-12), data["name"]
