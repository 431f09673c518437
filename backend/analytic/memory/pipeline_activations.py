"""A pipeline rank's saved activations when they peak: its in-flight microbatches (textbook/pipeline.py in-flight
counts under its schedule), every non-first stage's input buffers, the stage outputs it keeps for the sends
(analytic/pipelining.py) and, on the last stage, each in-flight microbatch's loss graph. One layout or arrays of
them (rank_activations.py calls it per layout with pipelining)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.layout import SCHEDULE_NAMES, Layout, PipelineSchedule
from backend.analytic.memory.activations import LOSS_BYTES
from backend.analytic.memory.moe_bytes import INDEX_BYTES
from backend.analytic.memory.parts import RankParts, StageComposition
from backend.analytic.scalar_or_array import logical_and, logical_or, maximum, minimum, select_present, where
from backend.analytic.textbook.pipeline import in_flight_terms
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


def in_flight(layout: Layout, pp_rank: Num) -> Num:
    """Peak (microbatch, chunk) forwards a pipeline rank holds under its schedule (textbook/pipeline.py): each
    layout's schedule picks its terms (only the schedules present are evaluated), then one expression over the
    pipeline ranks."""
    present = np.unique(layout.schedule).tolist() if isinstance(layout.schedule, np.ndarray) else [layout.schedule]
    terms = {k: in_flight_terms(SCHEDULE_NAMES[k], p=layout.pp, m=layout.microbatches, v=layout.virtual_stages)
             for k in present}
    if len(present) == 1:
        cap, base, per_stage = terms[present[0]]
    else:
        cap, base, per_stage = (select_present(layout.schedule, {k: t[i] for k, t in terms.items()}) for i in range(3))
    return minimum(cap, base + per_stage * (layout.pp - pp_rank))


def split_backward(layout: Layout) -> Num:
    """Whether the layout runs a schedule with separate input and weight passes (zero bubble, ZBV, DualPipeV:
    memory/split_backward.py)."""
    s = layout.schedule
    return logical_and(layout.pipelined, logical_or(s == PipelineSchedule.ZERO_BUBBLE, s == PipelineSchedule.ZBV,
                                                    s == PipelineSchedule.DUALPIPEV))


def held_stage_outputs(layout: Layout, parts: RankParts, units: Num, pp_rank: Num) -> Num:
    """pipelining.held_stage_outputs: the stage outputs a rank keeps alive for the stages that send to another rank
    (looped ranks: every stage but the last; ZBV's V turn hands stage p-1's output over locally)."""
    mb, sched = layout.microbatches, layout.schedule
    senders = layout.virtual_stages - parts.stages.last - logical_and(layout.zbv, pp_rank == layout.pp - 1)
    kept = where(sched == PipelineSchedule.GPIPE, mb,
                 where(sched == PipelineSchedule.ONE_F_ONE_B, minimum(mb, units + 1), mb * senders))
    return where(senders == 0, 0, kept)


def stage_grad_bytes(model: ModelSpec, layout: Layout) -> Num:
    """One microbatch's gradient of a stage boundary's residual stream (the stage input or output itself has the same
    size), (b, s, h) on this rank (split over tp under SP), fp32 under autocast: what a block's backward hands the
    block below, and a stage the stage before."""
    return (layout.micro_batch * layout.seq_local(model) * model.d_model / where(layout.sequence_parallel, layout.tp, 1)
            * where(layout.uses_autocast, MASTER_BYTES, layout.compute_bytes))


def held_chunks_bytes(layout: Layout, stages: StageComposition, blocks: Num, chunks: Num, lowest: Num) -> Num:
    """Saved bytes of `chunks` (microbatch, chunk) forwards a rank holds, each with its stage input, `lowest` of them
    its lowest stage's; `blocks`: one microbatch's saved bytes of all the rank's blocks. When the layers do not split
    evenly the lowest stage has the most blocks (sharding.layer_split). Only split-backward schedules tell the
    stages apart (their plans hold the most chunks on it: `peak_lowest`); elsewhere the average chunk."""
    v = layout.virtual_stages
    per_lowest = blocks * stages.n_lowest / maximum(stages.n_blocks, 1)
    per_other = (blocks - per_lowest) / maximum(v - 1, 1)
    return where(split_backward(layout), lowest * per_lowest + (chunks - lowest) * per_other, blocks * chunks / v)


def peak_lowest(layout: Layout, stages: StageComposition, pp_rank: Num, chunks: Num) -> Num:
    """Of a rank's `chunks` held at its most, its lowest stage's: torch 2.13's plans put 2p of them there under zero
    bubble and 2p - r under ZBV and DualPipeV (at most m; tests/unit/test_split_backward.py), one fewer on the rank
    with the last stage, whose moments are priced with one last-stage chunk's loss graph held."""
    most = where(layout.zbv, 2 * layout.pp - pp_rank, 2 * layout.pp)
    return minimum(minimum(maximum(chunks - stages.last, 0), most), layout.microbatches)


def recv_buffer_bytes(model: ModelSpec, layout: Layout, parts: RankParts) -> Num:
    """The rank's stages' receive buffers, one per microbatch for every non-first stage's input and every non-last
    stage's output gradient (analytic/pipelining.py held_stage_inputs; stage.py `_create_grad_recv_info`), each a
    stage boundary's residual stream. torch allocates them in the first step and keeps them, so they are alive at
    every moment, optimizer.step included."""
    stages, v = parts.stages, layout.virtual_stages
    return stage_grad_bytes(model, layout) * layout.microbatches * (2 * v - stages.first - stages.last)


def pipeline_saved(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts, terms: tuple,
                   autocast: Num) -> Num:
    """A pipeline rank's saved bytes when its activations peak: after its last forward (stages without the
    loss) or at the start of the last stage's last backward (the loss seed just made). terms: (blocks, emb_head,
    shard) with blocks = all of the rank's blocks of one microbatch."""
    blocks, emb_head, shard = terms
    stages, v = parts.stages, layout.virtual_stages
    units = in_flight(layout, pp_rank)
    seq = layout.seq_local(model)
    buf = stage_grad_bytes(model, layout)  # one stage input / output: the residual stream (fp32 under autocast)
    non_first = v - stages.first
    # in-flight chunks, each chunk's input included
    total = held_chunks_bytes(layout, stages, blocks, units, peak_lowest(layout, stages, pp_rank, units))
    total = total - units * buf * non_first / v  # non-first inputs: counted as receive buffers
    total = total + recv_buffer_bytes(model, layout, parts)
    total = total + buf * held_stage_outputs(layout, parts, units, pp_rank)
    learned_pos = str(getattr(model, "positions", "learned")) == "learned"
    if learned_pos:  # pos = arange(s) int64 per in-flight microbatch of the first stage
        total = total + where(stages.first, units / v * seq * INDEX_BYTES, 0.0)
    head = emb_head - seq * INDEX_BYTES * learned_pos - LOSS_BYTES
    head = head + shard
    mb = layout.microbatches
    k = where(layout.schedule == PipelineSchedule.GPIPE, mb, 1)  # textbook/pipeline.last_stage_in_flight
    # fp32 scalars: every microbatch's loss (kept to the step's end), nll_loss's total_weight per in-flight loss
    # graph, the ones_like loss seed of the backward (_backward.py stage_backward)
    return where(stages.last, total + k * head + 4 * (mb + k + 1), total)
