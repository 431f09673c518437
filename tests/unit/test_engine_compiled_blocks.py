"""This engine's compiled blocks in the memory model (stack shardlab, elementwise compiled): a block that recomputes
nothing keeps what Inductor saves (memory/compiled_block.py, measured in tests/unit/test_compiled_block.py, under
autocast too), in estimate and in the planner alike; what is not measured keeps the eager terms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.layout import Layout
from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
from backend.analytic.memory.compiled_block import compiled_block_bytes
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.planner.held import HeldTraining
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

MODEL = {"vocab_size": 512, "d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 256, "attention": "flash",
         "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "ffn_hidden": 352}


def _spec(train: dict, parallel: dict | None = None, device: str = "cpu", model: dict | None = None
          ) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": MODEL | (model or {}),
        "train": {"global_batch": 4, "micro_batch": 2, "precision": "bf16-mixed", **train},
        "parallel": parallel or {"strategy": "zero3", "world_size": 2}, "runtime": {"device": device}})


def test_only_this_engines_own_compiled_blocks_set_the_layout_flag():
    assert Layout.of(_spec({"elementwise": "compiled"})).blocks_compiled
    assert not Layout.of(_spec({})).blocks_compiled
    titan = Layout.of(_spec({"stack": "torchtitan", "elementwise": "compiled"}))
    assert not titan.blocks_compiled and titan.stack.compiled_blocks  # stack_activations' own compiled terms


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_blocks_save_what_inductor_keeps_per_block(strategy, device):
    """Eager minus compiled activations at the peak is, per block, the eager block's bytes less the measured compiled
    block's: under FSDP2's bf16 blocks (zero3) and under autocast (ddp: the fp32 block input, the same weight casts)."""
    parallel = {"strategy": strategy, "world_size": 2}
    eager, compiled = (_spec({"elementwise": e}, parallel, device) for e in ("eager", "compiled"))
    shape = LayerShape.of_spec(eager)
    assert shape.autocast == (strategy == "ddp")
    per_block = layer_activation_bytes(shape, "none") - compiled_block_bytes(shape)
    assert per_block > 0
    gap = estimate(eager).per_rank[0].activations_bytes - estimate(compiled).per_rank[0].activations_bytes
    assert gap == pytest.approx(MODEL["n_layers"] * per_block, rel=1e-12)


def test_checkpointed_compiled_blocks_keep_the_eager_terms():
    """Not measured under compile: a checkpointed block's re-run is priced eager (its unit, the block input, is the
    same either way)."""
    eager, compiled = (estimate(_spec({"elementwise": e, "recompute": "full"})).worst().moments()
                       for e in ("eager", "compiled"))
    assert eager == compiled


def test_selective_compiled_blocks_save_what_inductor_keeps_with_the_core_checkpointed():
    eager, compiled = (_spec({"elementwise": e, "recompute": "selective"}) for e in ("eager", "compiled"))
    shape = LayerShape.of_spec(eager)
    per_block = layer_activation_bytes(shape, "selective") - compiled_block_bytes(shape, selective=True)
    assert per_block > 0
    gap = estimate(eager).per_rank[0].activations_bytes - estimate(compiled).per_rank[0].activations_bytes
    assert gap == pytest.approx(MODEL["n_layers"] * per_block, rel=1e-12)


def test_layers_recompute_prices_only_its_plain_blocks_compiled():
    """layers:2 checkpoints blocks 0 and 2 (models/checkpointing.py); blocks 1 and 3 run plain, compiled."""
    eager, compiled = (_spec({"elementwise": e, "recompute": "layers:2"}) for e in ("eager", "compiled"))
    shape = LayerShape.of_spec(eager)
    per_block = layer_activation_bytes(shape, "none") - compiled_block_bytes(shape)
    gap = estimate(eager).per_rank[0].activations_bytes - estimate(compiled).per_rank[0].activations_bytes
    assert gap == pytest.approx(2 * per_block, rel=1e-12)


@pytest.mark.heavy
def test_the_planner_prices_compiled_blocks_as_estimate_does():
    """One model called by everything: the planner's worst-rank bytes with held compiled blocks equal
    worst_rank_bytes on each planned spec alone, and are below the eager table's on every layout whose plain blocks
    compile (tp 1: DTensor blocks are not measured)."""
    spec = _spec({"elementwise": "compiled", "micro_batch": 1}, {"strategy": "ddp", "world_size": 4})
    held = HeldTraining.of_train(spec.train.model_dump(mode="json"))
    assert held.engine_compile().blocks and not held.engine_compile().loss
    layouts = enumerate_layouts(spec.model, gpus=4, gpus_per_node=4, global_batch=4, precision="bf16-mixed",
                                compiled=held.engine_compile())
    memory, _ = worst_rank_memory(spec.model, layouts)
    eager, _ = worst_rank_memory(spec.model, replace(layouts, compiled=replace(layouts.compiled, blocks=False)))
    assert (memory <= eager).all() and (memory < eager).any()
    for i in range(0, len(layouts), max(1, len(layouts) // 20)):
        data = layouts.take(i).spec_dict(spec.model)
        data["train"]["elementwise"] = "compiled"
        one = light_spec(data)
        assert Layout.of(one).blocks_compiled
        assert worst_rank_bytes(one)[0] == pytest.approx(memory[i], rel=1e-12), data["name"]



def test_a_model_whose_blocks_differ_in_attention_kind_keeps_the_eager_terms():
    """Windowed layers with global ones (Gemma 3, gpt-oss): block 0 is windowed whenever the kinds differ
    (params.layer_attention_kind), compiled_block_bytes leaves windowed blocks out, and the per-kind constants
    (rank_activations.attention_kind_correction) are the eager blocks': every block stays eager, none half compiled."""
    windows = {"window": 64, "global_every": 2}
    mixed = [estimate(_spec({"elementwise": e}, model=windows)).worst().moments() for e in ("eager", "compiled")]
    assert mixed[0] == mixed[1]
