"""What a block's q / k and sandwich RMSNorms keep for backward (family_bytes.qk_norm_bytes, sandwich_norm_bytes),
against the eager block on the CPU: saved_tensors_hooks on one block of a Qwen3-like model (GQA, SwiGLU, q/k norm)
and of a Gemma-3-like one (GeGLU, sandwich norms), parameters and autocast's weight casts left out, each storage
once, in the three ways this engine runs a block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
from backend.analytic.memory.family_bytes import qk_norm_bytes, sandwich_norm_bytes
from backend.spec import ExperimentSpec
from tests.helpers.saved_bytes import MODES, block_saved_bytes

pytestmark = pytest.mark.unit

MODEL = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "seq_len": 256,
         "attention": "flash", "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none",
         "ffn_hidden": 704, "qk_norm": True, "tie_embeddings": False}
SANDWICH = {**{k: v for k, v in MODEL.items() if k != "qk_norm"}, "mlp": "geglu", "sandwich_norm": True}


def _spec(mode: str, model: dict = MODEL) -> ExperimentSpec:
    precision, strategy = MODES[mode]
    return ExperimentSpec.for_prediction({
        "model": model, "train": {"global_batch": 4, "micro_batch": 2, "precision": precision},
        "parallel": {"strategy": strategy, "world_size": 2}, "runtime": {"device": "cpu"}})


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("family", ["qk_norm", "sandwich"])
def test_an_eager_block_with_extra_norms_keeps_what_the_model_counts(mode, recompute, family):
    spec = _spec(mode, MODEL if family == "qk_norm" else SANDWICH)
    shape = LayerShape.of_spec(spec)
    assert (shape.qk_norm, shape.sandwich_norm) == (family == "qk_norm", family == "sandwich")
    assert shape.autocast == (mode == "autocast")
    assert block_saved_bytes(spec, mode, recompute == "selective") == layer_activation_bytes(shape, recompute)


def test_q_k_norms_on_cuda_keep_the_fused_kernels_input_and_rstd_or_under_autocast_the_composites():
    """bf16 weights on CUDA: the fused kernel's 16-bit input and fp32 rstd per head; autocast hands rms_norm a 16-bit
    input and an fp32 weight, so the composite runs as on the CPU: fp32 input and normalised x, fp32 rstd."""
    shape = replace(LayerShape.of_spec(_spec("bf16_params")), device="cuda")
    rows, widths, heads = 2 * 256, 256 + 128, 4 + 2
    assert qk_norm_bytes(shape) == rows * (widths * 2 + heads * 4)
    assert qk_norm_bytes(replace(shape, autocast=True)) == rows * 4 * (2 * widths + heads)
    assert qk_norm_bytes(replace(shape, device="cpu")) == rows * 4 * (2 * widths + heads)
    assert qk_norm_bytes(replace(shape, tp=2)) == qk_norm_bytes(shape) / 2
    assert qk_norm_bytes(replace(shape, qk_norm=False)) == 0


def test_sandwich_norms_on_cuda_keep_the_fused_kernels_input_and_rstd_or_under_autocast_the_composites():
    shape = replace(LayerShape.of_spec(_spec("bf16_params", SANDWICH)), device="cuda")
    rows, h = 2 * 256, 256
    assert sandwich_norm_bytes(shape) == 2 * rows * (h * 2 + 4)
    assert sandwich_norm_bytes(replace(shape, autocast=True)) == 2 * rows * 4 * (2 * h + 1)
    assert sandwich_norm_bytes(replace(shape, tp=2)) == sandwich_norm_bytes(shape)  # every tp rank holds them whole
    assert sandwich_norm_bytes(replace(shape, sandwich_norm=False)) == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sandwich_norms_under_tp_run_on_the_ranks_sequence_shard_with_sp(precision, sequence_parallel):
    """Under TP the sandwich norms are replicated, and under SP (SequenceParallel, tp_placement) they see the rank's
    s / tp tokens: one tp rank's block, placed by the engine's TP plan on the fake process group, keeps what the model
    counts (was 8,320 B over at SP, the norms counted whole)."""
    from tests.helpers.engine_measure import block_saved_bytes_on_fake_pg

    model = SANDWICH | {"d_model": 64, "n_layers": 2, "seq_len": 32, "ffn_hidden": 176}
    spec = ExperimentSpec.model_validate({
        "model": model, "train": {"global_batch": 4, "micro_batch": 2, "precision": precision},
        "parallel": {"strategy": "tp", "world_size": 2, "sequence_parallel": sequence_parallel},
        "runtime": {"device": "cpu"}})
    shape = LayerShape.of_spec(spec)
    assert (shape.tp, shape.sequence_parallel, shape.sandwich_norm) == (2, sequence_parallel, True)
    assert block_saved_bytes_on_fake_pg(spec, rank=1) == layer_activation_bytes(shape)
