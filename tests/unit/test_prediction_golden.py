"""Issue 23: moving the prediction into one core changed no number. Digests of every number of 846 estimates (423
valid specs drawn with a fixed seed over six model families x every strategy x tp / pp / ep degrees x schedule x
precision x recompute x optimizer, on CPU and CUDA storage rules), of 139 step_time results, and of the planner's
worst-rank bytes and pipeline rank on every enumerated layout of five models, recorded with the code before the
core (a6476c0: analytic/estimate._memory per rank, planner/vmemory.py). Notes (prose) are not digested."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from backend.analytic.estimate import estimate
from backend.analytic.layout import PipelineSchedule, RecomputeMode
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.planner.space import enumerate_layouts
from backend.spec import ExperimentSpec, ModelSpec

# ESTIMATES_BEFORE / PLANNER_BEFORE re-recorded once since (issue 22 C, RMSNorm saved bytes per device:
# analytic/device.rms_norm_saved_bytes): only activations_bytes / total_bytes of RMSNorm models moved (171 of 846
# estimates: every CUDA one with saved norms, CPU bf16 under FSDP2's bf16 params; 30 planner rows). Then the per-rank
# field loss_backward_temp_bytes was added (without it the digest is 084ca46d2234eeed73e9, every other number as
# before).
# STEP_TIMES_BEFORE re-recorded with the per-device operation tables (issue 22 B): the step times on h100-sxm moved
# on purpose; the RMSNorm change (issue 22 C) moved no step time.
# Then issue 26 moved all three (main's b1db28418adc6a03115b, 16ab12f230336f1eceff, 6776c972a54ebb4c7d41 before):
# zero1 x tp / pp is now Megatron's distributed optimizer (16-bit params, fp32 main grads, sharded masters;
# reduce-scatter + all-gather instead of all-reduce + broadcast). Compared entry by entry with main's values: the 125
# estimates / step times and the planner rows that moved are all zero1 x tp / pp layouts (comm bytes by collective,
# params / grads / optimizer / activation bytes, dp comm seconds); every other number is identical.
# Then issue 35 moved all three (2601f78a8e1e6963fe38, a83bbb994af7b1d5d1a0, a2ad81bc641c69427123 before): zero1 x ep
# runs Megatron's distributed optimizer with the experts in buckets of their own over edp (reduce-scatter + all-gather
# instead of all-reduce + ZeroRedundancyOptimizer's broadcast; 16-bit params under bf16). Compared entry by entry with
# 4a157ac's values: the 15 estimates / step times and the 18 planner rows that moved are all MoE zero1 x ep layouts;
# every dense number is identical.
# Issue 32 (the fullest moment) moved ESTIMATES_BEFORE (main's 87e63b4bb3e3524abbc3) and PLANNER_BEFORE (main's
# bf1eee46254808b9f9af), compared entry by entry with main at the merge: in all 846 estimates no existing field
# changed (optimizer_temp_bytes included, now from memory/optimizer_step.py); each rank only gains loss_backward_bytes,
# backward_bytes, fullest_bytes and fullest_moment. The planner's worst-rank bytes are now the fullest moment: on every
# row of the five cases the activation peak (rank_memory(...).total_bytes, pipeline rank by it) equals main's value
# byte for byte, and the new value is >= it on every row (higher on 26,077 of 26,952; the worst pipeline rank moved on
# 1,992). STEP_TIMES_BEFORE is unchanged.
# Issue 32 again (pipelined x recompute inside backward, read op by op off the traced grid): moved ESTIMATES_BEFORE
# (062b716c4ef3cfcec9a5 before) and PLANNER_BEFORE (54fe0a942a45161561f6 before). Compared entry by entry with
# aa6324e: the 226 of 846 estimates that moved are all pipelined bf16-mixed ones, and only in backward_bytes,
# loss_backward_bytes, fullest_bytes and fullest_moment (fullest -15.9% .. +0.6%); planner rows moved only on
# pipelined bf16-mixed layouts (none of the fp32 "gpt" case's, none without pipelining; -8.8% .. +10.0%).
# Issue 32 again (the 7B zero3 x tp8 x pp4 layers:2 miss, read tensor by tensor at the traced peak): a later 1F1B
# backward of every stage but the first holds the previous backward's stage-input gradient (sent_grad_bytes), in its
# backward moments and the last stage's loss backward; layers:K adds its lowest checkpoint's moment (no golden layout
# uses layers:K). Moved ESTIMATES_BEFORE (50396e95b372907cd931 before) and PLANNER_BEFORE (1e26f82de8eafe26de7d
# before); compared entry by entry with 9259fe0: the 88 of 846 estimates that moved are every 1F1B one (pp 2 and 4, fp32
# and bf16-mixed) and no other, only on ranks past the first stage (332 ranks) and only in backward_bytes,
# loss_backward_bytes and fullest_bytes (fullest +0.06% .. +1.12%); planner rows moved only on 1F1B layouts (2,732 of
# 26,952), all up (+0.00% .. +2.38%), the worst pipeline rank on 17 of them. STEP_TIMES_BEFORE is unchanged.
# Issue 32 again (GPipe and interleaved 1F1B backwards, memory/schedule_backward.py, against the traced peaks of
# tests/fixtures/traced_peaks/gpipe_interleaved.json): moved ESTIMATES_BEFORE (50eec552bf6e6fedb784 before) and
# PLANNER_BEFORE (4db462ce34646580b8ef before); compared entry by entry with 03452e5: the 109 of 846 estimates that
# moved are all GPipe (82) or interleaved 1F1B (27) ones, only in backward_bytes, fullest_bytes and fullest_moment
# (fullest -7.10% .. +0.66% on 450 ranks); planner rows moved only on GPipe and interleaved layouts (1,489 of 26,952,
# -12.17% .. +0.42%, the worst pipeline rank on 56). STEP_TIMES_BEFORE is unchanged.
# Issue 32 again (zero bubble, ZBV and DualPipeV: memory/split_backward.py, against the traced peaks of
# tests/fixtures/traced_peaks/split_backward.json): moved ESTIMATES_BEFORE (cf7444a088c877ec7a0b before) and
# PLANNER_BEFORE (b01199871930787c8a4a before); compared entry by entry with 40c3e46: the 126 of 846 estimates that
# moved are all zero bubble (52) or ZBV (74) ones (the golden draw has no DualPipeV), only in loss_backward_bytes,
# backward_bytes, fullest_bytes and fullest_moment, all up (fullest +0.12% .. +30.8% on 596 ranks); planner rows moved
# only on zero bubble, ZBV and DualPipeV layouts, all up (+0.02% .. +438%: Llama-70B ZBV tp8 pp16 full recompute at
# micro-batch 8, its last rank's 31 waiting chunks' output gradients).
# STEP_TIMES_BEFORE is unchanged.
# Issue 32 again (every pipeline receive buffer: torch keeps one per microbatch for each non-last stage's output
# gradient too, stage.py `_create_grad_recv_info`; the traced fixtures now count them all): moved ESTIMATES_BEFORE
# (ca783e25eb8379464ea4 before) and PLANNER_BEFORE (52fbd720e057f5036d5e before); compared entry by entry with
# 317d8ac: every estimate gains the per-rank field recv_buffer_bytes (0 without pipelining); the 492 of 846 that moved
# otherwise are all pipelined, only in activations_bytes, total_bytes, loss_backward_bytes, backward_bytes,
# fullest_bytes and fullest_moment, all up (fullest +0.10% .. +9.30% on 2,500 ranks); planner rows moved only on
# pipelined layouts, all up (29,845 of 47,208 rows of all five cases, +0.002% .. +75.0%: Llama-70B tp8 pp64 1F1B at
# 512 microbatches, 64 GiB of output-gradient buffers; the worst pipeline rank on 949). STEP_TIMES_BEFORE is unchanged.
# Then every rank gained the field late_grads_bytes (DualPipeV's rank 0 at m = 2p; 0 on every golden estimate, which
# draws no DualPipeV): without that key the digest is 8d5d41b9dd44983a1424, as before.
# Issue 32 again (split backwards on a rank's lowest stage: it holds the most chunks under zero bubble, ZBV and
# DualPipeV and has the most blocks on an uneven split; a chunk fewer held keeps its input; a V schedule's same-rank
# hand-over is no input pass done; DualPipeV's overlapped backwards): moved ESTIMATES_BEFORE (96e42d80368979638a04
# before) and PLANNER_BEFORE (df4158f56fde395bb11d before); compared entry by entry with 747df48: the 106 of 846
# estimates that moved are all zero bubble (32) or ZBV (74) ones, only in activations_bytes, total_bytes,
# loss_backward_bytes, backward_bytes and fullest_bytes (fullest -1.38% .. +15.7% on 548 ranks); planner rows moved only
# on zero bubble, ZBV and DualPipeV layouts (6,339 of 47,208; -6.5% .. +31.8%). STEP_TIMES_BEFORE is unchanged.
# Issue 32 again (ZBV at m = p microbatches holds m + r + 1 chunks on pipeline rank r, not 2p: torch's
# ScheduleZBVZeroBubble action lists, textbook/pipeline.py; its frontier follows): moved ESTIMATES_BEFORE
# (bebea293f1fb4836132e before) and PLANNER_BEFORE (6b450af33a0a597c7075 before); compared entry by entry with bbc2c6f:
# the 42 of 846 estimates that moved are all ZBV ones at m < 2p, only in activations_bytes, total_bytes,
# loss_backward_bytes, backward_bytes, fullest_bytes and fullest_moment (fullest -18.5% .. +0.15% on 272 ranks);
# planner rows moved only on ZBV layouts with m < 2p (1,752 of 47,208; -83.0% .. +1.94%). STEP_TIMES_BEFORE is
# unchanged.
# Then ZBV at m = p makes every rank's first-leg gradients after its activation peak, as DualPipeV's rank 0 at
# m = 2p does (split_backward.first_leg_late_grad_bytes, now counting that stage's own blocks): moved ESTIMATES_BEFORE
# (eaa26707323d80cd1450 before) and PLANNER_BEFORE (c477f092c53a1b2d74b9 before); compared entry by entry with 02df4f6:
# the 16 estimates that moved are all ZBV at m = p, only in grads_bytes, late_grads_bytes, total_bytes,
# loss_backward_bytes, backward_bytes, fullest_bytes and fullest_moment (fullest -4.99% .. -0.69% on 48 ranks); planner
# rows moved only on ZBV at m = p and DualPipeV at m = 2p (345 of 47,208, all down, -7.06% .. -0.05%).
# StepTime gained `caveats` (the notes that qualify the number, shown with it by estimate and New experiment): its
# empty list is the only change to STEP_TIMES_BEFORE (f4c874761017f01d24d4 before, the same digest with the key
# popped; none of the 139 has a caveat).
# Issue 34 (an MoE block under autocast, read op by op off saved_tensors_hooks: a gated expert's gate and up each keep
# their own 16-bit cast of the routed rows, index_add keeps its source in the fp32 output dtype, an MoE block has no
# dense gate / up cast of ln2's output, and the shared expert's sigmoid gate keeps its own cast and a 16-bit (N, 1)
# output): moved ESTIMATES_BEFORE (1b6b45ed85e9dc5350ec before) and PLANNER_BEFORE (a2847da65a8a9a9654d4 before);
# compared entry by entry with 752f9bf: the 98 of 846 estimates that moved are all MoE bf16-mixed ones that run under
# autocast (MOE and MOES), only in activations_bytes, total_bytes, loss_backward_bytes, backward_bytes and
# fullest_bytes (fullest +0.05% .. +2.27% on 521 ranks, all up; no fullest_moment moved); planner rows moved only in
# the "moe" case (2,333 of its 4,464 rows, all up, +0.004% .. +7.34%; the worst pipeline rank on 42).
# STEP_TIMES_BEFORE is unchanged.
# An MoE block re-run under recompute holds its dense dispatch's (tokens, h) accumulator (memory/policy_blocks.py,
# tests/unit/test_recompute_policies.py): moved ESTIMATES_BEFORE (477ecaf936bc11f587f6 before) and PLANNER_BEFORE
# (9e1c3c10a1f559148aab before). Compared entry by entry with 5171a92: the 55 of 846 estimates that moved are all MoE
# full recompute without ep (31 fp32, 24 bf16-mixed), in activations_bytes / total_bytes (264 ranks) and
# backward_bytes / fullest_bytes (12 ranks; fullest +0.00% .. +0.25%); planner rows moved only in the "moe" case, 2 of
# 4,464, both full recompute without ep (+0.19%, +0.22%). STEP_TIMES_BEFORE is unchanged. (The golden draw has no
# mixed dense / MoE stack: pricing each block at its own kind moved no number here.)
ESTIMATES_BEFORE = "54124897056a8c9b4979"
STEP_TIMES_BEFORE = "ef134c59104f99bb69f0"
PLANNER_BEFORE = "6d9d8ea0f556bda47758"

T = dict(vocab_size=250, d_model=96, n_layers=5, n_heads=4, seq_len=32)
ODD = dict(vocab_size=251, d_model=90, n_layers=5, n_heads=3, seq_len=30, ffn_hidden=333)
MOE = dict(vocab_size=250, d_model=64, n_layers=2, n_heads=4, seq_len=32, n_experts=4, top_k=2)
MOES = dict(vocab_size=250, d_model=64, n_layers=4, n_heads=4, seq_len=32, n_experts=4, top_k=2, n_shared_experts=1,
            shared_expert_gate=True, norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
LL = dict(vocab_size=300, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=176, seq_len=32, norm="rmsnorm",
          mlp="swiglu", positions="rope", bias="none", attention="flash")
TIED = dict(vocab_size=250, d_model=64, n_layers=6, n_heads=4, seq_len=32, tie_embeddings=True)
MODELS = {"T": T, "ODD": ODD, "MOE": MOE, "MOES": MOES, "LL": LL, "TIED": TIED}
LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
PLANNER_CASES = {
    "tiny": (ModelSpec(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                       seq_len=2048, **LLAMA), 32, 64, "bf16-mixed"),
    "moe": (ModelSpec(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=2816,
                      seq_len=1024, n_experts=8, top_k=2, n_shared_experts=1, shared_expert_gate=True, **LLAMA),
            32, 64, "bf16-mixed"),
    "gpt": (ModelSpec(vocab_size=50257, d_model=1536, n_layers=12, n_heads=12, seq_len=1024, tie_embeddings=True),
            48, 96, "fp32"),
    "small": (ModelSpec(vocab_size=1000, d_model=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=352, seq_len=64),
              16, 32, "bf16-mixed"),
    "l70": (ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                      seq_len=4096, **LLAMA), 1024, 1024, "bf16-mixed"),
}
DEGREES = ((1, 1, 1, 1), (2, 1, 1, 1), (3, 1, 1, 1), (4, 2, 1, 1), (4, 1, 2, 1), (6, 3, 1, 1), (8, 2, 2, 1),
           (4, 1, 1, 2), (4, 1, 1, 4), (8, 1, 1, 2), (12, 3, 2, 1), (8, 1, 4, 1))
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2))


def spec_dicts() -> list[dict]:
    rng = random.Random(5)
    out = []
    for m in MODELS.values():
        for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            for world, tp, pp, ep in DEGREES:
                if ep > 1 and "n_experts" not in m:
                    continue
                for schedule, v in SCHEDULES:
                    if pp == 1 and schedule != "1f1b":
                        continue
                    for precision in ("fp32", "bf16-mixed"):
                        for recompute in ("none", "selective", "full"):
                            sp = tp > 1 and rng.random() < 0.5
                            dp = world // (tp * pp)
                            micro = rng.choice([1, 2])
                            out.append({"model": m, "parallel": {
                                "strategy": strategy, "world_size": world, "tp": tp, "pp": pp, "ep": ep,
                                "sequence_parallel": sp, "pp_schedule": schedule, "virtual_stages": v},
                                "train": {"global_batch": dp * micro * rng.choice([1, 2, pp * 2]), "micro_batch": micro,
                                          "precision": precision, "recompute": recompute,
                                          "optimizer": rng.choice(["adamw", "adamw", "sgd"])}})
    rng.shuffle(out)
    return out[:900]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _plain(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


@pytest.mark.heavy
def test_estimates_and_step_times_unchanged():
    estimates, steps = {}, {}
    hw = get_hardware("h100-sxm")
    for i, data in enumerate(spec_dicts()):
        try:
            spec = ExperimentSpec.for_prediction(data)
        except Exception:  # noqa: BLE001 - the draw includes invalid layouts; the digests cover the valid ones
            continue
        for device in ("cpu", "cuda"):
            numbers = _plain(estimate(spec, device=device).to_dict())
            numbers.pop("notes")
            estimates[f"{i}-{device}"] = numbers
        if i % 3 == 0:
            steps[str(i)] = _plain(step_time(spec, hw, gpus_per_node=4).to_dict())
    assert len(estimates) == 846 and len(steps) == 139
    assert _digest(estimates) == ESTIMATES_BEFORE
    assert _digest(steps) == STEP_TIMES_BEFORE


def test_planner_worst_rank_memory_unchanged():
    out = {}
    for name, (model, gpus, batch, precision) in PLANNER_CASES.items():
        layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision)
        layouts = layouts.take(layouts.recompute <= RecomputeMode.FULL)  # the policies searched when recorded
        memory, at = worst_rank_memory(model, layouts)
        # the layouts of a6476c0's space: EP x PP layouts were added to it later (issue 24), EP x TP and DualPipeV
        # (issue 35) too, not digested here
        ep, schedule = np.asarray(layouts.ep), np.asarray(layouts.schedule)
        old_space = ~((ep > 1) & ((np.asarray(layouts.pp) > 1) | (np.asarray(layouts.tp) > 1))) \
            & (schedule != PipelineSchedule.DUALPIPEV)
        out[f"{name}-mem"] = np.asarray(memory)[old_space].tolist()
        out[f"{name}-where"] = np.asarray(at)[old_space].tolist()
    assert _digest(_plain(out)) == PLANNER_BEFORE
