"""What one MoE block (the engine's dense dispatch: every expert on this rank) keeps for backward, against the eager
block on the CPU: saved_tensors_hooks on the block, parameters and autocast's weight casts left out, each storage
once, in the three ways this engine runs a block. Under autocast a gated expert's gate and up each keep their own
16-bit cast of the routed rows, index_add keeps its source in the fp32 output dtype (moe_bytes.expert_input_copies,
activations.dense_moe_layer_bytes), an MoE block has no dense gate / up, and the shared expert's sigmoid gate keeps its
own cast (family_bytes.family_extra_bytes)."""

from __future__ import annotations

import pytest

from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
from backend.spec import ExperimentSpec
from tests.helpers.saved_bytes import MODES, block_saved_bytes

pytestmark = pytest.mark.unit

MOE = {"vocab_size": 128, "d_model": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32,
       "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash",
       "n_experts": 4, "top_k": 2, "expert_ffn_hidden": 32, "tie_embeddings": False}
VARIANTS = {
    "swiglu": {}, "gelu": {"mlp": "gelu"}, "clamped": {"mlp": "swiglu_clamped"},
    "shared_gated": {"n_shared_experts": 1, "shared_ffn_hidden": 32, "shared_expert_gate": True},
    "shared_gelu": {"mlp": "gelu", "n_shared_experts": 1, "shared_ffn_hidden": 32},
    "capacity": {"capacity_factor": 1.25},
}


def _spec(mode: str, **model) -> ExperimentSpec:
    precision, strategy = MODES[mode]
    return ExperimentSpec.for_prediction({
        "model": MOE | model, "train": {"global_batch": 4, "micro_batch": 2, "precision": precision},
        "parallel": {"strategy": strategy, "world_size": 2}, "runtime": {"device": "cpu"}})


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_eager_moe_block_keeps_what_the_model_counts(mode, variant):
    spec = _spec(mode, **VARIANTS[variant])
    shape = LayerShape.of_spec(spec)
    assert shape.n_experts == 4 and shape.autocast == (mode == "autocast")
    assert block_saved_bytes(spec, mode) == layer_activation_bytes(shape, "none")


@pytest.mark.parametrize("mode", list(MODES))
def test_grouped_gemm_experts_keep_no_16_bit_weight_copy(mode):
    """moe_grouped_gemm: GroupedLinear casts the experts' weights inside its own Function and saves the fp32 ones, so
    under autocast none of their 16-bit copies is kept (the helper takes one per 2-D weight off); besides, the block
    keeps the int32 group offsets (E x 4 B). expert_casts.grouped_expert_elems counts exactly the copies left out."""
    from backend.analytic.layout import Layout
    from backend.analytic.memory.expert_casts import grouped_expert_elems

    spec = _spec(mode, moe_grouped_gemm=True)
    weights, biases = grouped_expert_elems(spec.model, Layout.of(spec))
    assert (weights, biases) == (4 * 3 * 64 * 32, 0)
    cast_bytes = 2 * weights if mode == "autocast" else 0
    offsets = 4 * 4
    expected = layer_activation_bytes(LayerShape.of_spec(spec), "none") + offsets - cast_bytes
    assert block_saved_bytes(spec, mode) == expected
