"""Megatron's distributed optimizer (zero1 x tp / pp, issue 26): runs, matches the single-process reference, and its
model states are exactly Megatron's 6 + 12/dp bytes per parameter under bf16-mixed (8 + 8/dp in fp32) plus the
buckets' padding and one AdamW `step` per bucket (Megatron-LM docs/source/api-guide/dist_optimizer.md table). In
ranks (the farm's): the traced model states equal the prediction and torchrun runs match the single-process
reference."""

from __future__ import annotations

import pytest

from backend.analytic.dp_buckets import bucket_groups, bucket_numels, bucket_of, padded
from backend.analytic.estimate import estimate
from backend.analytic.layout import Layout
from backend.analytic.sharding import local_params
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.checks import run_blockers
from tests.helpers.farm import assert_parity, params, parity_job, trace_job
from tests.helpers.specs import tiny

MODEL = {"vocab_size": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}


MEGATRON = {"stack": "megatron", "attention_kernel": "flash2", "elementwise": "eager"}
"""Megatron-Core's memory layout as an engine option (issue 34 part 4): the megatron stack with the kernels this
engine runs; its zero1 is the distributed optimizer whatever the degrees, sharded over dp x cp."""


def _spec(precision: str, train: dict | None = None, model: dict | None = None, **parallel) -> ExperimentSpec:
    return ExperimentSpec.model_validate({"model": MODEL | (model or {}),
                                          "train": {"global_batch": 8, "micro_batch": 2, "precision": precision,
                                                    **(train or {})},
                                          "parallel": {"strategy": "zero1", "world_size": 4, **parallel}})


def test_buckets_are_embeddings_blocks_head_padded_to_dp():
    assert [bucket_of(n)[1] for n in ("tok_emb.weight", "pos_emb.weight", "layers.3.attn.q.weight", "norm.weight",
                                       "lm_head.weight")] == ["embeddings", "embeddings", "layers.3", "head", "head"]
    assert padded(10, 4) == 12 and padded(12, 4) == 12 and padded(0, 4) == 0


@pytest.mark.parametrize(("precision", "per_param", "per_param_over_dp"), [("bf16-mixed", 6, 12), ("fp32", 8, 8)])
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}], ids=["dp2xtp2", "dp2xpp2"])
def test_predicted_model_states_are_megatrons(precision, per_param, per_param_over_dp, parallel):
    """Megatron's table: bf16 params + fp32 grads = 6 B, fp32 master + Adam m, v = 12 B over dp (fp32: 4 + 4, m + v
    over dp); ShardLab counts the 16-bit params as params, the fp32 main grads as grads, master + m + v as optimizer."""
    spec = _spec(precision, **parallel)
    for rank in range(4):
        r = estimate(spec).per_rank[rank]
        params = local_params(spec, rank)
        buckets = bucket_numels(params, 2)
        n = sum(buckets)
        assert n % 2 == 0 and n >= sum(q.local_numel for q in params)
        assert r.params_bytes + r.grads_bytes == per_param * n
        assert r.optimizer_bytes == per_param_over_dp * n // 2 + 4 * len(buckets)  # + one 4-B AdamW step per bucket
    assert not run_blockers(spec)


def test_mixed_stack_buckets_count_each_block_kind():
    """DeepSeek-V3's dense prefix and MoE blocks (a mixed stack) at dp16 x pp16 (zbv): every rank's buffers hold its
    own blocks' kinds, 6 B per parameter (+ dp padding) as Megatron's table says; the buckets of the MoE blocks were
    once counted at the dense block's size (47 B parameters on a rank shown as 3.5 GB)."""
    from backend.presets import preset_model

    spec = ExperimentSpec.for_prediction({
        "model": preset_model("deepseek-v3"),
        "train": {"global_batch": 1024, "micro_batch": 4, "precision": "bf16-mixed", "recompute": "full"},
        "parallel": {"strategy": "zero1", "world_size": 256, "pp": 16, "pp_schedule": "zbv", "virtual_stages": 2},
        "runtime": {"device": "cuda"}})
    for r in estimate(spec).per_rank[::16]:
        assert r.params_bytes + r.grads_bytes == pytest.approx(6 * r.params_count, rel=1e-6)


def test_fp16_stays_prediction_only_and_zero1_x_ep_runs_the_distributed_optimizer():
    fp16 = ExperimentSpec.for_prediction({"model": MODEL, "train": {"global_batch": 8, "micro_batch": 2,
                                                                    "precision": "fp16-mixed"},
                                          "parallel": {"strategy": "zero1", "world_size": 4, "tp": 2}})
    assert "fp16 loss scaling" in run_blockers(fp16)[0]
    # issue 35: zero1 x ep is Megatron's distributed optimizer with the experts' buckets over edp = dp x cp / ep
    ep = {"model": {**MODEL, "n_experts": 4}, "parallel": {"strategy": "zero1", "world_size": 4, "ep": 2}}
    spec, problems = validate_spec(ep)
    assert problems == [] and run_blockers(spec) == [] and Layout.of(spec).distributed_optimizer
    params = local_params(spec, 0)
    groups = bucket_groups(params, 4, edp=2)
    assert [g for _, g in groups].count(2) == 2  # one expert bucket per MoE block, over edp = 2
    assert all(n % g == 0 for n, g in groups)


# ---- in ranks (the farm): traced on fake tensors, and torchrun runs against the reference ---------------------

TRACES = {"dp2xtp2-sp": trace_job(_spec("bf16-mixed", tp=2, sequence_parallel=True)),
          "dp2xpp2": trace_job(_spec("bf16-mixed", pp=2)),
          "megatron-dp4": trace_job(_spec("bf16-mixed", train=MEGATRON)),
          "megatron-dp2xcp2": trace_job(_spec("bf16-mixed", cp=2, train=MEGATRON, model={"attention": "flash"}))}


@pytest.mark.parametrize("layout", params(TRACES))
def test_traced_model_states_equal_the_prediction(farm, layout):
    """The engine's own set-up and tracker on fake tensors (the real bf16 run at world 4 gave the same bytes: dp2 x tp2
    params 119,424 / grads 238,848 / optimizer 358,288 on every rank)."""
    res = farm.result(TRACES[layout])
    assert res["status"] == "ok", res
    # The megatron stack is predicted as Megatron-Core keeps it on a GPU (memory/stack_states.megatron_state): AdamW's
    # `step` on the host. On CPU ranks torch keeps one 4-B step tensor per optimizer tensor on the device: one per
    # bucket of this engine's distributed optimizer (each block, the embeddings, the head).
    steps = 4 * (MODEL["n_layers"] + 2) if layout.startswith("megatron") else 0
    for row in res["per_rank"]:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            extra = steps if key == "optimizer_bytes" else 0
            assert row["traced"][key] == row["predicted"][key] + extra, (row["rank"], key, row)


PARITY = {s.name: parity_job(s, timeout_s=400) for s in [
    tiny("zero1_dp2_tp2_sp_tied", model={"tie_embeddings": True}, strategy="zero1", world_size=4, tp=2,
         sequence_parallel=True),
    tiny("zero1_dp2_pp2_tied", model={"tie_embeddings": True, "n_layers": 4}, strategy="zero1", world_size=4, pp=2,
         pp_schedule="interleaved_1f1b", virtual_stages=2),
    # split backward: the weight passes assign .grad by hand (no hook fires), swept in at step
    tiny("zero1_dp2_pp2_zbv", model={"n_layers": 4}, strategy="zero1", world_size=4, pp=2, pp_schedule="zbv",
         virtual_stages=2, train={"global_batch": 8, "micro_batch": 1}),
    # the megatron stack's zero1 without tp / pp: the distributed optimizer over dp, and over dp x cp
    tiny("megatron_zero1_dp4", strategy="zero1", world_size=4, train=MEGATRON),
    tiny("megatron_zero1_dp2_cp2", model={"attention": "flash"}, strategy="zero1", world_size=4, cp=2, train=MEGATRON),
]}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(PARITY))
def test_parity_with_the_single_process_reference(farm, name):
    """fp32: the owned slices step exactly as the whole parameters do (AdamW is elementwise); 1e-4 as every mix."""
    result = farm.result(PARITY[name])
    assert_parity(result)
    assert any("Megatron's distributed optimizer" in n for n in result["notes"])
