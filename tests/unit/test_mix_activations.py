"""Activation predictions of the model-parallel strategies (PP schedules, TP MoE) against hand-derived values, and
against the activations the engine measures (the farm's engine jobs, within the analytic bound).

Fixed tiny model (as benchmarks/mp_accuracy.py): V=64, h=32, 4 layers, 4 heads, s=16, micro-batch 1, ffn 4h, fp32.
Hand derivation of one block, one microbatch (backend/models/gpt.py ops, elements):
  ln1 in 512 + ln2 in 512 + ln1/ln2 outputs 1024 + o input 512 + q/k/v copies 1536 + probs a·s² 1024
  + MLP hidden 2·s·ffn 4096 = 9216 elements = 36,864 B, + LayerNorm mean/rstd 2·2·16·4 = 256 B
  + causal mask s² bool = 256 B  ->  BLOCK = 37,376 B.
One stage input/output (b, s, h) fp32: BUF = 2,048 B. Head per microbatch (last stage): norm input 2,048 + lm_head
input 2,048 + norm stats 128 + logits 16·64·4 = 4,096 + fp32 log-probs 4,096 = HEAD = 12,416 B.
"""

from __future__ import annotations

import pytest

from backend.analytic.estimate import estimate
from backend.analytic.memory import activations as A
from backend.analytic.pipelining import held_stage_inputs, held_stage_outputs
from backend.spec import ExperimentSpec
from tests.helpers.farm import engine_job, uses

BLOCK, BUF, HEAD, POS = 37_376, 2_048, 12_416, 16 * 8
MOE = {"n_experts": 4, "top_k": 2}


def spec(name: str, *, model: dict | None = None, train: dict | None = None, **parallel) -> ExperimentSpec:
    m = {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16} | (model or {})
    t = {"global_batch": 8, "micro_batch": 1, "steps": 2, "warmup_steps": 1} | (train or {})
    return ExperimentSpec.model_validate({"name": name, "model": m, "train": t, "parallel": parallel})


def pp(sched: str, world: int = 2, **train) -> ExperimentSpec:
    v = 2 if sched in ("interleaved_1f1b", "zero_bubble", "zbv") else 1
    return spec(f"pp{world}_{sched}", model={"n_layers": max(4, world * v)}, train=train or None, strategy="pp",
                pp_schedule=sched, virtual_stages=v, world_size=world)


def acts(s: ExperimentSpec) -> list[int]:
    return [r.activations_bytes for r in estimate(s).per_rank]


def test_block_constant_matches_the_layer_model():
    assert A.model_layer_activation_bytes(s=16, b=1, h=32, a=4, kv_heads=4, ffn=128, dtype_bytes=4) == BLOCK


def test_1f1b_last_stage_holds_every_microbatch_input_buffer():
    # stage 1 (layers 2, 3), 1 microbatch in flight, its input counted once; 8 persistent recv buffers;
    # one loss graph; scalars: 8 losses + 1 total_weight + the ones_like seed
    want = 2 * BLOCK - BUF + 8 * BUF + HEAD + 4 * (8 + 1 + 1)
    assert acts(pp("1f1b"))[1] == want


def test_1f1b_last_stage_grows_with_microbatches_not_in_flight():
    # old model: last stage independent of m; torch keeps one recv buffer and one loss scalar per microbatch
    assert acts(pp("1f1b"))[1] - acts(pp("1f1b", global_batch=4))[1] == 4 * BUF + 4 * 4


def test_1f1b_first_stage_keeps_one_sent_output_beyond_in_flight():
    # 2 microbatches in flight (p - stage), outputs: 2 in fwd_cache + the warm-up send Work's; the last block's
    # MLP output next to the closing residual add; pos per in-flight microbatch; 8 output-gradient recv buffers
    assert acts(pp("1f1b"))[0] == 2 * 2 * BLOCK + 3 * BUF + BUF + 2 * POS + 8 * BUF


def test_gpipe_last_stage_holds_every_loss_graph():
    # all 8 microbatches in flight: their blocks (inputs = the 8 recv buffers), 8 heads,
    # scalars: 8 losses + 8 total_weight + the seed
    assert acts(pp("gpipe"))[1] == 8 * 2 * BLOCK + 8 * HEAD + 4 * (8 + 8 + 1)
    assert acts(pp("gpipe"))[0] == 8 * 2 * BLOCK + 8 * BUF + BUF + 8 * POS + 8 * BUF  # + grad recv buffers


def test_interleaved_sending_stage_holds_all_outputs():
    # rank 1 holds stages 1 and 3 (1 layer each): 3 chunks in flight (inputs counted as held inputs),
    # 2 x 8 input buffers, stage 1's 8 output-gradient buffers, stage 1 sends 8 outputs kept by `send_ops`, one loss
    # graph + scalars
    want = 3 * BLOCK - 3 * BUF + 16 * BUF + 8 * BUF + 8 * BUF + HEAD + 4 * (8 + 1 + 1)
    assert acts(pp("interleaved_1f1b"))[1] == want


def test_held_outputs_per_schedule():
    kw = dict(m=8, in_flight=4, n_stages=4)
    assert held_stage_outputs("interleaved_1f1b", stages=[0, 2], **kw) == 16
    assert held_stage_outputs("zbv", stages=[1, 2], **kw) == 8  # 1 -> 2 stays on the rank
    assert held_stage_outputs("zbv", stages=[0, 3], **kw) == 8  # 3 is last
    assert held_stage_outputs("1f1b", stages=[0], **kw) == 5
    assert held_stage_outputs("1f1b", stages=[0], m=4, in_flight=4, n_stages=2) == 4
    assert held_stage_outputs("gpipe", stages=[3], **kw) == 0
    assert held_stage_inputs(m=8, stages=[0, 3]) == 8


def test_recv_buffers_stay_through_the_optimizer_step():
    """The receive buffers are alive from step to step: the optimizer.step moment keeps them (8 input + 8
    output-gradient buffers on zbv's rank 1, stages 1 and 2 of 4)."""
    r = estimate(pp("zbv")).per_rank[1]
    assert r.recv_buffer_bytes == (8 + 8) * 2 * BUF
    assert r.moments()["optimizer_step"] == r.total_bytes - r.activations_bytes + r.optimizer_temp_bytes \
        + r.recv_buffer_bytes
    assert estimate(spec("ddp", strategy="ddp", world_size=2)).per_rank[0].recv_buffer_bytes == 0


def test_moe_experts_hidden_split_over_tp():
    # experts are Colwise fc_in / Rowwise fc_out: GELU in + fc_out in are (rows, ffn/t); rows = s·b·k = 32
    kw = dict(s=16, b=1, h=32, ffn=128, n_experts=4, top_k=2, dtype_bytes=4)
    assert A.dense_moe_layer_bytes(**kw) - A.dense_moe_layer_bytes(**kw, t=2) == 2 * 32 * 64 * 4
    assert A.dense_moe_layer_bytes(**kw) - A.dense_moe_layer_bytes(**kw, t=4) == 2 * 32 * 96 * 4


def test_tp_moe_layer_uses_split_experts():
    kw = dict(s=16, b=1, h=32, a=4, kv_heads=4, ffn=128, dtype_bytes=4, t=2, sp=True)
    moe = A.model_layer_activation_bytes(**kw, **MOE)
    dense = A.model_layer_activation_bytes(**kw)
    # dense MLP hidden 2·s·ffn/t = 2048 el. replaced by the MoE term with (rows, ffn/t) hidden
    assert moe - dense == A.dense_moe_layer_bytes(s=16, b=1, h=32, ffn=128, dtype_bytes=4, t=2, **MOE) - 2 * 16 * 64 * 4


def test_full_recompute_first_stage_peaks_at_the_rerun_block():
    # 1F1B stage 0, 2 microbatches in flight: checkpoints keep each block's input (2 x 2 x BUF), 3 held outputs,
    # pos x 2, 8 output-gradient recv buffers; the last block's re-run in backward adds one block minus its input (no
    # head on this stage, and the end-of-forward MLP transient is gone by then)
    held = 2 * 2 * BUF + 3 * BUF + 2 * POS + 8 * BUF
    assert acts(pp("1f1b", recompute="full"))[0] == held + BLOCK - BUF


# ---- on the engine (the farm): measured activations within the analytic bound -------------------------------

# 8 microbatches: the old model missed every one of these by 16-31 % (26 % for MoE)
ON_ENGINE = [engine_job(s) for s in [pp(sched, steps=1) for sched in ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")]
             + [spec("tp2_moe_sp", model=MOE, train={"steps": 1}, strategy="tp", sequence_parallel=True, world_size=2)]]


@pytest.mark.slow
@uses(*ON_ENGINE)
def test_mp_activations_within_bound_on_engine(farm):
    bad = []
    for job in ON_ENGINE:
        res = farm.result(job)["result"]
        assert res.status == "ok", res.error
        for rr in res.per_rank:
            e = rr.error_pct.get("activations_bytes")
            if e is None or abs(e) > 15:
                got, want = rr.measured.activations_bytes, rr.predicted.activations_bytes
                bad.append(f"{job.name} r{rr.rank}: {got} vs {want} ({e})")
    assert not bad, bad
