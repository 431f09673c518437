"""What GPipe's and interleaved 1F1B's backwards hold differently from 1F1B's (backward_moment.py builds its
pipelined candidates with these terms). One layout or arrays of them; each term is 0 (or the value backward_moment.py
used before) on every other schedule, so the other schedules' moments do not move.

Read tensor by tensor off traced zero3 x tp2 x pp3 steps (12 layers, 6 microbatches, none / full recompute, ranks 0,
4 and 8: tests/fixtures/traced_peaks/gpipe_interleaved.json) against torch 2.13's schedules
(torch/distributed/pipelining/schedules.py, stage.py):
- GPipe (ScheduleGPipe._step_microbatches, schedules.py:905-931 every forward with its loss, then 933-946 every
  backward in microbatch order): a finished backward released its microbatch's whole graph and, popping its
  `fwd_cache` entry (stage.py:966), its stage output and logits, but not its stage input (the receive buffer, kept to
  the step's end); every loss backward after the first runs with every unit unsharded and the gradients accumulated.
- interleaved 1F1B (ScheduleInterleaved1F1B, run by _PipelineScheduleRuntime._step_microbatches, schedules.py:
  2407-2610): each action is one chunk's `forward_one_chunk` / `backward_one_chunk`, so a backward holds only its own
  chunk's 16-bit weight grads, and a later backward that follows another chunk's forward finds that chunk's zero3
  units resharded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, PipelineSchedule, ZeroStage
from backend.analytic.memory.activations import LOSS_BYTES
from backend.analytic.memory.parts import RankParts
from backend.analytic.memory.pipeline_activations import stage_grad_bytes
from backend.analytic.memory.pipelined_backward import PipelineBackward, overlapped
from backend.analytic.scalar_or_array import ceil_div, logical_and, logical_not, logical_or, where

if TYPE_CHECKING:
    from backend.analytic.memory.rank_activations import ActivationMoments
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


def gpipe(layout: Layout) -> Num:
    """Whether the layout runs torch's ScheduleGPipe (every forward, then every backward)."""
    return logical_and(layout.pipelined, layout.schedule == PipelineSchedule.GPIPE)


def interleaved(layout: Layout) -> Num:
    """Whether the layout runs torch's ScheduleInterleaved1F1B (zero bubble, ZBV and DualPipeV split their backwards:
    memory/split_backward.py models them instead of these terms)."""
    return logical_and(layout.pipelined, layout.schedule == PipelineSchedule.INTERLEAVED_1F1B)


def stale_logits_shards(model: ModelSpec, layout: Layout, parts: RankParts) -> Num:
    """GPipe's last stage: the TP logits shards `ActivationMoments.held` counts once per held loss graph; none is alive
    in a backward (lm_head's local (b, s, V/tp) output is all-gathered and cat into the logits by the forward that
    makes it, and autograd saves neither). activations.tp_logits_shard_bytes on layouts, times the microbatches."""
    shard = layout.micro_batch * layout.seq_local(model) * ceil_div(model.vocab_size, layout.tp) * layout.compute_bytes
    last = logical_and(gpipe(layout), parts.stages.last)
    return where(logical_and(last, layout.tp > 1), layout.microbatches * shard, 0)


def kept_stage_input(model: ModelSpec, layout: Layout, parts: RankParts) -> Num:
    """GPipe, a stage past the first: a microbatch's stage input (the receive buffer, part of `acts.blocks`) that its
    backward does not free: the buffers stay to the step's end (pipeline_activations counts mb of them)."""
    return where(logical_and(gpipe(layout), logical_not(parts.stages.first)), stage_grad_bytes(model, layout), 0)


def finished_microbatch_bytes(model: ModelSpec, layout: Layout, parts: RankParts, acts: ActivationMoments) -> Num:
    """What a later backward's start no longer holds of the finished microbatch: its blocks' saved tensors (1F1B and
    the looped schedules: `acts.blocks`); GPipe: less its kept stage input, plus its stage output on a stage that sends
    one and, on the last stage, its loss graph, logits and loss scalars (the `fwd_cache` entry popped, stage.py:966)."""
    stages = parts.stages
    logits = layout.seq_local(model) * layout.micro_batch * model.vocab_size * layout.compute_bytes
    sent_out = where(logical_and(gpipe(layout), logical_not(stages.last)), stage_grad_bytes(model, layout), 0)
    loss_graph = where(logical_and(gpipe(layout), stages.last), acts.head_freed + logits + LOSS_BYTES, 0)
    return acts.blocks - kept_stage_input(model, layout, parts) + sent_out + loss_graph


def chunk_blocks(layout: Layout, parts: RankParts) -> Num:
    """The blocks whose 16-bit weight grads a later backward holds: interleaved and DualPipeV's overlapped phase, one
    chunk's (each backward is one chunk's `backward_one_chunk`, schedules.py:2562-2567, which waits only for that
    chunk's casts' node)."""
    one_chunk = logical_or(interleaved(layout), overlapped(layout))
    return where(one_chunk, parts.stages.n_blocks / layout.virtual_stages, parts.stages.n_blocks)


def overlapped_loss_graph(parts: RankParts, layout: Layout, acts: ActivationMoments) -> Num:
    """DualPipeV's rank 0: the forward before each of its first stage's overlapped backwards is the last stage's
    (torch 2.13's plan: F7.4 then B0.0 at p = 4), whose loss graph (the head's saved tensors, the logits) waits for
    its own backward, so those backwards hold what the head's backward frees elsewhere (read tensor by tensor at the
    7B ddp x tp8 x pp4 trace's peak: the in-flight microbatch's fp32 and bf16 logits). 0 elsewhere."""
    return where(logical_and(overlapped(layout), parts.stages.last), acts.head_freed, 0)


def later_units_bytes(layout: Layout, parts: RankParts, every_unit: Num) -> Num:
    """FSDP2's unsharded parameters at a later backward of the first stage's embeddings: every unit (`every_unit`),
    except on an interleaved zero3 rank, where that backward follows another chunk's forward, which resharded that
    chunk's units (zero3 = reshard_after_forward=True; stage.py:846 keeps a chunk's units only after its own
    backward): the root's and this chunk's blocks'."""
    stages = parts.stages
    root = stages.first * parts.embeddings.fsdp_unsharded_numel + stages.last * parts.head.fsdp_unsharded_numel
    chunk = layout.fsdp_param_bytes * (root + chunk_blocks(layout, parts) * parts.last_block.fsdp_unsharded_numel)
    zero3 = logical_and(layout.fsdp, layout.zero_stage == ZeroStage.ZERO3)
    return where(logical_and(zero3, interleaved(layout)), chunk, every_unit)


def later_loss_bytes(model: ModelSpec, layout: Layout, parts: RankParts, cool: Num, unsharded: Num,
                     pipe: PipelineBackward, acts: ActivationMoments) -> Num:
    """GPipe's last stage, a loss backward after the first (schedules.py:933-946): the finished microbatches' release
    (`cool`, accumulated unsharded grads included) with every unit unsharded (`unsharded`: kept since the first
    backward, stage.py:846), the working microbatch's loss graph, and log_softmax's backward's two fp32 (b, s, V)
    tensors (the grad of the log-probs and of the logits; a compiled loss: its 16-bit gradient). 0 elsewhere."""
    sbv = layout.seq_local(model) * layout.micro_batch * model.vocab_size
    later = logical_and(logical_and(gpipe(layout), parts.stages.last), pipe.has_later)
    loss_grads = sbv * (layout.compute_bytes if layout.loss_compiled else 2 * 4)
    return where(later, cool + acts.head_freed + unsharded + loss_grads, 0)
