"""The activation model per device and precision mode, against what torch saves: RMSNorm's fused CUDA kernel keeps
its input and an fp32 rstd, the CPU composite keeps fp32 input, rstd and normalised x (analytic/device.py
rms_norm_saved_bytes). The CUDA side is judged on the committed H200 measurements
(benchmarks/results/gpu/2026-11-26-h200-run{1,2}/report.json: the saved-tensor listings of one block, and the real
runs' per-category bytes), the CPU side by running torch here, and through the real engine on the CPU (a farm
engine job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.analytic.device import rms_norm_saved_bytes
from backend.analytic.estimate import estimate
from backend.spec import ExperimentSpec
from tests.helpers.farm import engine_job, uses

GPU_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
H200_RUNS = ("2026-11-26-h200-run1", "2026-11-26-h200-run2")
LISTINGS = "2026-11-26-h200-run2"  # run 1 had no diag phase
CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
BOUND_PCT = 3.0  # issue 22 C: every real world-1 run predicted within 3% in memory per category


def report(name: str) -> dict:
    return json.loads((GPU_RESULTS / name / "report.json").read_text())


def ok_runs() -> list[tuple[str, dict]]:
    return [(f"{name}/{run['gpu_check']['run']}", run) for name in H200_RUNS for run in report(name)["runs"]
            if run.get("status") == "ok"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_rms_norm_saves_what_the_model_says(dtype):
    """nn.RMSNorm on the CPU (torch's rms_norm_composite): fp32 input (a copy of a 16-bit one), fp32 rstd, fp32
    normalised x; the weight is a parameter, not an activation."""
    norm = torch.nn.RMSNorm(48).to(dtype)
    x = torch.randn(3, 20, 48, dtype=dtype, requires_grad=True)
    weight = norm.weight.untyped_storage().data_ptr()
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() != weight:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    assert sum(saved.values()) == rms_norm_saved_bytes(sbh=3 * 20 * 48, sb=3 * 20, input_bytes=x.element_size(),
                                                       device="cpu")


def test_cuda_rms_norm_keeps_input_and_rstd_only():
    sbh, sb = 4096 * 2048, 4096
    assert rms_norm_saved_bytes(sbh=sbh, sb=sb, input_bytes=2, device="cuda") == 2 * sbh + 4 * sb
    assert rms_norm_saved_bytes(sbh=sbh, sb=sb, input_bytes=4, device="cuda") == 4 * sbh + 4 * sb
    assert rms_norm_saved_bytes(sbh=sbh, sb=sb, input_bytes=2, device="cpu") == 4 * (2 * sbh + sb)


def test_committed_saved_tensor_listings_match_the_model_per_device_and_mode():
    """Every listing of run 2's diag (one block + head of the 1B shape and the compare shape; CUDA and CPU; autocast
    and bf16 params) against the model for its device: the block within 0.01% (was -12.1% CUDA autocast, -7.7% CUDA
    bf16 params, +15.3% CPU bf16 params), the embedding + head + loss within 0.1% (the int64 inputs and targets
    the listing counts are the engine's `other`)."""
    from backend.gpucheck.saved_tensors import SHAPES, analytic

    checked = 0
    for entry in report(LISTINGS)["diag"]["saved_tensors"]:
        for mode, listing in entry["modes"].items():
            model = analytic(SHAPES[entry["shape"]], entry["device"], mode)
            totals = listing["unique_bytes"]
            held_logits = listing["logits_bytes"] if mode == "autocast" else 0
            where = (entry["device"], entry["shape"], mode)
            assert totals["block"] == pytest.approx(model["block_bytes"], rel=1e-4), where
            head = totals["head_and_loss"] + totals["embedding"] + held_logits
            assert head == pytest.approx(model["embedding_head_loss_bytes"], rel=1e-3), where
            checked += 1
    assert checked == 6


@pytest.mark.parametrize(("name", "run"), ok_runs(), ids=[n for n, _ in ok_runs()])
def test_committed_h200_runs_are_predicted_within_3_pct_per_category(name, run):
    """The real H200 runs (world 1, NCCL, Llama-3.2-1B shape, seq 4096, bf16-mixed: ddp under autocast, zero2/zero3
    under FSDP2's bf16 params, recompute none/selective/full) fed through today's model: each category within 3%
    (activations were -4.5% zero2/zero3, -6.6% ddp: RMSNorm's CUDA kernel saves neither the normalised x nor an fp32
    copy)."""
    spec = ExperimentSpec.model_validate(run["spec"])
    predicted = estimate(spec, device="cuda").per_rank[0]
    measured = run["per_rank"][0]["measured"]
    for cat in CATEGORIES:
        pred = getattr(predicted, cat)
        assert abs(measured[cat] - pred) / pred * 100 <= BOUND_PCT, (name, cat, measured[cat], pred)


def test_cuda_estimate_says_rmsnorm_is_fused():
    run = ok_runs()[0][1]
    spec = ExperimentSpec.model_validate(run["spec"])
    assert any("RMSNorm runs torch's fused kernel" in n for n in estimate(spec, device="cuda").notes)
    assert not any("RMSNorm" in n for n in estimate(spec, device="cpu").notes)


ZERO3_BF16 = engine_job(ExperimentSpec.model_validate({
    "name": "zero3-bf16-rmsnorm",
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
              "seq_len": 64, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none",
              "attention": "flash", "tie_embeddings": True},
    "train": {"global_batch": 2, "micro_batch": 1, "steps": 1, "warmup_steps": 1, "precision": "bf16-mixed"},
    "parallel": {"strategy": "zero3", "world_size": 1}}))


@uses(ZERO3_BF16)
def test_cpu_zero3_bf16_params_run_measures_the_predicted_activations(farm):
    """The engine on the CPU (gloo, world 1): FSDP2 with bf16 MixedPrecisionPolicy runs the norms on bf16 inputs,
    which the CPU composite upcasts (the CPU GPU-check kit's zero3 runs were +16.7% before)."""
    result = farm.result(ZERO3_BF16)["result"]
    assert result.status == "ok", result.error
    rank = result.per_rank[0]
    for cat in CATEGORIES:
        assert getattr(rank.measured, cat) == pytest.approx(getattr(rank.predicted, cat), rel=1e-3), cat
