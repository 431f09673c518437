"""Grouped GEMM experts (memory/expert_casts.py) in engine runs at world 2 on the farm, with experts (8 x ffn 128 at
d_model 64) that outweigh the activations:
- under pipelining a rank's activation peak is inside its last block's forward of the last in-flight microbatch, at
  the down projection's stacked expert weights, over the in-flight microbatches' saved tensors and stage buffers
  (1F1B over 4 microbatches; before the stack was counted the prediction was 8% (stage 0) and 10.6% (stage 1) under);
- under FSDP2 that moment is the peak too, with the root and the last block unsharded (zero3 bf16-mixed: params were
  predicted at the loss, 34% under, before fsdp_state.head_peak knew the moment)."""

from __future__ import annotations

import pytest

from backend.result import error_pct
from tests.helpers.farm import engine_job, uses
from tests.helpers.specs import tiny

MOE = {"n_layers": 4, "d_model": 64, "seq_len": 32, "vocab_size": 128, "norm": "rmsnorm", "mlp": "swiglu",
       "positions": "rope", "bias": "none", "attention": "flash", "n_experts": 8, "top_k": 2, "expert_ffn_hidden": 128,
       "moe_grouped_gemm": True}
SPEC = tiny("grouped_experts_pp2_1f1b", model=MOE, train={"microbatches": 4, "warmup_steps": 1}, strategy="pp",
            world_size=2, pp=2, pp_schedule="1f1b")
JOB = engine_job(SPEC)
FSDP = tiny("grouped_experts_zero3_bf16", model=MOE, train={"precision": "bf16-mixed", "warmup_steps": 1},
            strategy="zero3", world_size=2)
FSDP_JOB = engine_job(FSDP)


@pytest.mark.slow
@uses(JOB)
def test_a_pipeline_ranks_activation_peak_holds_the_down_projections_stack(farm):
    """Within 3%: the last stage's moment holds about 2.6% more than the model counts (measured; the first stage
    +0.6%)."""
    res = farm.result(JOB)["result"]
    assert res.status == "ok", res.error
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= 1e-5, (res.loss, res.loss_reference)
    for rr in res.per_rank:
        for cat in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert getattr(rr.measured, cat) == getattr(rr.predicted, cat), (rr.rank, cat)
        e = error_pct(rr.measured.activations_bytes, rr.predicted.activations_bytes)
        assert abs(e) <= 3.0, (rr.rank, rr.measured.activations_bytes, rr.predicted.activations_bytes)


@pytest.mark.slow
@uses(FSDP_JOB)
def test_under_fsdp2_the_stack_moment_holds_the_unsharded_last_block(farm):
    """Model states exact at that moment; activations within 1.5% (bf16 rounding aside, 0.8% under measured)."""
    res = farm.result(FSDP_JOB)["result"]
    assert res.status == "ok", res.error
    for rr in res.per_rank:
        for cat in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert getattr(rr.measured, cat) == getattr(rr.predicted, cat), (rr.rank, cat)
        e = error_pct(rr.measured.activations_bytes, rr.predicted.activations_bytes)
        assert abs(e) <= 1.5, (rr.rank, rr.measured.activations_bytes, rr.predicted.activations_bytes)
