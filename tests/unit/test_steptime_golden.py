"""step_time and the planner's exact worst-rank memory are unchanged by the speed work (one-pass makespan, memoised
per-rank work): a digest of every number step_time returns (per rank, per stage) and of worst_rank_bytes over 86
Llama-2-70B layouts on 1,024 GPUs, recorded with the code before that work (commit 78cae89)."""

from __future__ import annotations

import hashlib
import json

import pytest

from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.layout import PipelineSchedule, RecomputeMode
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.schedule import SIMULATED
from backend.planner.space import enumerate_layouts, light_spec
from benchmarks.planner_speed import BATCH, GPUS, LLAMA70B, NODE

DIGEST_BEFORE = "ba8ea311d8cbcdc11e52"
"""Issue 32 moved worst_rank_bytes an eighth time (d0d406fb253b5862e23f before): ZBV with m = p microbatches holds
m + r + 1 chunks on pipeline rank r, not 2p (torch's ScheduleZBVZeroBubble action lists; textbook/pipeline.py), and
its frontier follows; compared row by row with bbc2c6f, the 5 rows that moved are all ZBV at m = pp, all down (-0.61%
.. -54.0%, tp2 pp32 full: 124.9 -> 57.5 GB), the worst rank moved on three; the step_time rows and the 81 others are
unchanged.
Issue 32 moved worst_rank_bytes a seventh time (9c60fd449a70cc8f1c5f before): under zero bubble and ZBV a rank's
lowest stage holds the most chunks, and has the most blocks when the layers split unevenly (80 over 64 stages here:
pipeline_activations.held_chunks_bytes); a chunk fewer held keeps its input, a receive buffer; a V schedule's
same-rank hand-over is no input pass done. Compared row by row with 747df48, the 14 rows that moved are all zero
bubble (4) or ZBV (10) (-1.92% .. +30.8%, ZBV tp4 pp32 none: 529.5 -> 692.4 GB), the worst rank moved on two (to
pipeline rank 15's); the step_time rows and the 72 others are unchanged.
Issue 32 moved worst_rank_bytes a sixth time (4ef7bb4ed66b4f9a1a1e before): every pipeline stage's output-gradient
receive buffers, one per microbatch, kept from step to step (memory/pipeline_activations.recv_buffer_bytes); compared
row by row with 317d8ac, the 63 rows that moved are all pipelined (interleaved 24, 1F1B 13, ZBV 13, zero bubble 10,
GPipe 3), all up (+0.04% .. +45.9%, interleaved pp32 at 256 microbatches: 149.7 -> 218.4 GB), the worst rank moved on
one; the step_time rows and the 23 others are unchanged.
Issue 32 moved worst_rank_bytes a fifth time (544d9c154e68a847b6ec before): zero bubble and ZBV hold each chunk's
Linear / norm output gradients (lm_head's and the final norm's on the last stage) between its input and weight passes
and each finished input pass's input gradient, and a weight pass re-runs its checkpointed blocks
(memory/split_backward.py); compared row by row with 40c3e46, the 21 rows that moved are all zero bubble (10) or ZBV
(11), all up (+0.02% .. +201%, zero bubble tp8 pp32 full: 35.7 -> 107.4 GB), the worst rank moved on 16 of them (to
the last pipeline rank's); the step_time rows and the 65 others are unchanged.
Issue 32 moved worst_rank_bytes a fourth time (f44613e5ca8c76dd8af1 before): GPipe and interleaved 1F1B backwards
(memory/schedule_backward.py: no TP logits shard held per loss graph, a finished GPipe microbatch's loss graph
released, GPipe's later loss backward, one chunk's weight grads and units per interleaved backward); compared row by
row with 03452e5, the 15 rows that moved are all GPipe (9) or interleaved 1F1B (6, v 2 and 4), all down (-0.02% ..
-7.90%), the same worst rank; the step_time rows and the 71 others are unchanged.
Issue 32 moved worst_rank_bytes a third time (57a88abc0f3c2416cdaa before): a later 1F1B backward of a stage past
the first holds the previous backward's stage-input gradient, and layers:K's lowest checkpoint is a moment of its own;
compared row by row with 7077052, one row moved, plan dp64·tp8·pp2 zero3 1F1B (63.831 -> 63.965 GB, +0.21%, the same
worst rank 512), the step_time rows and the 85 others are unchanged.
Issue 32 moved worst_rank_bytes again (13baa88a62c36977edfe before): pipelined bf16-mixed layouts' moment inside
backward (re-run blocks' casts come from autocast's cache, later backwards hold the blocks before's and the head's
16-bit grads); compared row by row with aa6324e, the 30 rows that moved are all pipelined (-5.2% .. +2.9%), the
step_time rows and the 56 others are unchanged.
Issue 32 moved worst_rank_bytes on purpose (the fullest moment inside backward: all-gathered and prefetched blocks,
unsharded grads before their reduce-scatter, the re-run block's activations); compared row by row with 53c5df1cb32f,
80 of the 86 rows grew (+0.03% to +124%), none shrank, the worst rank and the step_time rows are unchanged.
Before that: re-recorded when merged with the FSDP2 pipeline peak-state rules (fsdp_state) and `other` = the dp slice
(OTHER_IS_DP_SLICE): worst_rank_bytes moved by those on purpose; the step_time rows alone hash the same as at
78cae89 (345a23988e991f141f0b), so the speed work still changes no number."""
STEP_DIGEST_BEFORE = "3db8a397c3b4ddadd40e"
"""StepTime gained `caveats` (the notes that qualify the number): its empty list is the only change to both digests
(135e568f55f6b9206eb0 and b2e6b4907a118d8aa0ce before, the same with the key popped; none of the 86 rows has one).
Re-recorded with the per-device operation tables (issue 22 B): every step_time number on h100-sxm moved on purpose
(GEMM / attention / element-wise tables, dgrad and wgrad shapes, the eager-PyTorch element-wise kernels, optimizer
and loss bandwidths, kernel floors); worst_rank_bytes and the worst rank are unchanged (their digest alone is the
same before and after: befedda1ddb56b58fe99). Then issue 26 moved both (main's db5f4076a8e921c09a1a /
0bdfb277cee6ff11af98 before): zero1 x tp / pp is Megatron's distributed optimizer (16-bit params, reduce-scatter +
all-gather instead of all-reduce + broadcast); compared row by row with main's, the 20 rows that changed are all
zero1 x tp / pp layouts, the other 66 are identical."""


def _digest(rows: list) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:20]


@pytest.mark.heavy
def test_step_time_and_worst_rank_unchanged_on_70b_layouts():
    hw = get_hardware("h100-sxm")
    L = enumerate_layouts(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, global_batch=BATCH)
    # the recompute policies and schedules searched when the digests were recorded (dualpipev came later)
    L = L.take((L.recompute <= RecomputeMode.FULL) & (L.schedule != PipelineSchedule.DUALPIPEV))
    rows, schedules = [], set()
    for _ in range(2):  # the second pass answers from the memos: it must give the same numbers
        rows = []
        for i in range(0, len(L), 97):
            s = light_spec(L.take(i).spec_dict(LLAMA70B))
            if s.parallel.pp > 1:
                schedules.add(str(s.parallel.pp_schedule))
            w, r = worst_rank_bytes(s)
            rows.append((step_time(s, hw, gpus_per_node=NODE).to_dict(), w, r.rank))
        assert _digest(rows) == DIGEST_BEFORE
        assert _digest([r[0] for r in rows]) == STEP_DIGEST_BEFORE
    assert len(rows) == 86 and set(SIMULATED) <= schedules, schedules
