"""What a pipelined stage's backward holds beyond a plain one (backward_moment.py builds its candidates from these):
which backwards a stage runs (`pipeline_backward`), the gradient 1F1B keeps of the previous backward
(`sent_grad_bytes`), and layers:K's lowest checkpoint (`lowest_checkpoint`). One layout or arrays of them.

The schedules are torch's (torch/distributed/pipelining/schedules.py, torch 2.13): a stage's backwards are
`backward_one_chunk` calls of its `_PipelineStageBase`; FSDP2 keeps every unit unsharded after its backward and
accumulates unsharded gradients until the last microbatch (reshard_after_backward=False, no sync before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, PipelineSchedule, RecomputeMode, ZeroStage
from backend.analytic.memory.parts import RankParts
from backend.analytic.memory.pipeline_activations import stage_grad_bytes
from backend.analytic.scalar_or_array import logical_and, logical_not, logical_or, maximum, minimum, where

if TYPE_CHECKING:
    from backend.analytic.memory.rank_activations import ActivationMoments
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class PipelineBackward:
    """`steady`: a later backward follows a forward with as many microbatches in flight as the first (1F1B with more
    microbatches than the warm-up, DualPipeV's overlapped phase); `has_later`: the stage runs more than one backward
    (otherwise, and in the cool-down, consecutive backwards hold one microbatch fewer each)."""

    steady: Num
    has_later: Num


def overlapped(layout: Layout) -> Num:
    """DualPipeV: its steady phase runs one chunk's forward and the other chunk's full backward as one action
    (OVERLAP_F_B, torch/distributed/pipelining/schedules.py ScheduleDualPipeV), so each of those backwards starts with
    as many chunks in flight as the forward before it left, and is one chunk's `backward_one_chunk`."""
    return logical_and(layout.pipelined, layout.schedule == PipelineSchedule.DUALPIPEV)


def pipeline_backward(layout: Layout, pp_rank: Num) -> PipelineBackward:
    """Which backwards stage `pp_rank` runs (PipelineBackward)."""
    mb = layout.microbatches
    warm = minimum(mb, layout.pp - pp_rank)
    one_f_one_b = logical_and(layout.schedule == PipelineSchedule.ONE_F_ONE_B, mb > warm)
    return PipelineBackward(steady=logical_or(one_f_one_b, overlapped(layout)), has_later=mb > 1)


def sent_grad_bytes(model: ModelSpec, layout: Layout, parts: RankParts) -> Num:
    """1F1B: what a later backward of a stage that sends gradients (every stage but the first) still holds of the
    previous backward: its stage-input gradient, referenced by the schedule's `bwd_sends` (steady state) / `send_work`
    (cool-down) until the next backward returns (torch/distributed/pipelining/schedules.py
    Schedule1F1B._step_microbatches). Read tensor by tensor at the traced peaks of the 7B zero3 x tp8 x pp4 layout: one
    fp32 (b, s, h) made by the previous backward, in the middle stages' later backwards and the last stage's last loss
    backward. 0 without a previous backward (one microbatch) and under the other schedules."""
    sends = logical_and(logical_and(layout.schedule == PipelineSchedule.ONE_F_ONE_B, layout.pipelined),
                        logical_and(logical_not(parts.stages.first), layout.microbatches > 1))
    return where(sends, stage_grad_bytes(model, layout), 0)


@dataclass(frozen=True)
class PipeTerms:
    """What a pipelined stage's backward candidates share (backward_moment_bytes): `base` what the stage holds when a
    backward starts (autocast's cached casts included), `steady` / `cool` a later backward's start in the steady state /
    the cool-down (the accumulated unsharded gradients included), `grads` the first backward's unsharded block
    gradients once every block is back-propagated, `unsharded` every FSDP2 unit's parameters, `sent_grad` the previous
    backward's stage-input gradient a later backward still holds, `n_blocks` the stage's blocks, `rerun_extra` a re-run
    block's backward tensors (block_backward.py), `grad_bytes` the bytes of an element of FSDP2's unsharded grads."""

    base: Num
    steady: Num
    cool: Num
    grads: Num
    unsharded: Num
    sent_grad: Num
    pipe: PipelineBackward
    n_blocks: Num
    rerun_extra: Num
    grad_bytes: Num


def lowest_checkpoint(layout: Layout, acts: ActivationMoments, parts: RankParts, t: PipeTerms) -> Num:
    """layers:K under pipelining: the stage's lowest checkpoint (its K-th block) re-run while the K - 1 plain blocks
    below it still hold their saved tensors. Going down, each block frees its saved tensors but, in a pipelined
    backward, leaves its FSDP2 unit unsharded, its unsharded gradients (the first backward) or its 16-bit weight grads
    (a later one) behind; a plain block saves more than that, so under layers:K this moment beats the stage's first
    block (the 7B zero3 x tp8 x pp4 layers:2 trace peaks in the middle stages' second block, at its LayerNorm's
    backward: 2.8-3.3% above the first block's moment). 0 for the other policies and where no such block exists."""
    n = t.n_blocks
    k = maximum(layout.recompute_layers, 1)
    exists = logical_and(logical_and(layout.recompute == RecomputeMode.LAYERS, k > 1), acts.ck.units > 0)
    fsdp, zero3, pb = layout.fsdp, layout.zero_stage == ZeroStage.ZERO3, layout.fsdp_param_bytes
    blk = parts.last_block.fsdp_unsharded_numel
    stages = parts.stages
    root = stages.first * parts.embeddings.fsdp_unsharded_numel + stages.last * parts.head.fsdp_unsharded_numel
    # zero3 after a forward: the backward gathered the blocks from the working one up, and prefetched the one below
    units = parts.total("fsdp_unsharded_numel")
    gathered = where(fsdp, pb * where(zero3, root + minimum(n - k + 2, n) * blk, units), 0)
    work = (k - 1) * acts.plain + acts.none + t.rerun_extra - acts.blocks
    # the first backward: the K - 1 blocks below have made no gradients yet
    below_grads = where(fsdp, (k - 1) * t.grad_bytes * parts.last_block.fsdp_unsharded_grad_numel, 0)
    first = t.base + work + gathered + t.grads - below_grads
    # a later one: the 16-bit weight grads of the n - K blocks above wait for the shared casts' node
    held = (n - k) * acts.one_block_casts + acts.head_casts + t.sent_grad
    later = maximum(where(t.pipe.steady, t.steady + gathered, t.cool + t.unsharded), t.cool + t.unsharded) + work + held
    return where(exists, maximum(first, where(t.pipe.has_later, later, 0)), 0)
