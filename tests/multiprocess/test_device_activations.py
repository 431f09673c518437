"""The activation model on the CPU through the real engine (a torchrun launch): FSDP2 with bf16 params runs the norms
on bf16 inputs, which the CPU composite upcasts (analytic/device.rms_norm_saved_bytes). The saved-tensor and H200
checks of the same model are in tests/unit/test_device_activations.py."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


def test_cpu_zero3_bf16_params_run_measures_the_predicted_activations(tmp_path):
    """The engine on the CPU (gloo, world 1): FSDP2 with bf16 MixedPrecisionPolicy runs the norms on bf16 inputs,
    which the CPU composite upcasts (the CPU GPU-check kit's zero3 runs were +16.7% before)."""
    from tests.helpers.engine_batch import launch

    model = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
             "seq_len": 64, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none",
             "attention": "flash", "tie_embeddings": True}
    spec = ExperimentSpec.model_validate({
        "name": "zero3-bf16-rmsnorm", "model": model,
        "train": {"global_batch": 2, "micro_batch": 1, "steps": 1, "warmup_steps": 1, "precision": "bf16-mixed"},
        "parallel": {"strategy": "zero3", "world_size": 1}})
    result = launch(1, [spec], tmp_path)[spec.name]["result"]
    assert result.status == "ok", result.error
    rank = result.per_rank[0]
    for cat in CATEGORIES:
        assert getattr(rank.measured, cat) == pytest.approx(getattr(rank.predicted, cat), rel=1e-3), cat
