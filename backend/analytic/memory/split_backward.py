"""Zero bubble, ZBV and DualPipeV: what a chunk holds between its input pass and its weight pass, and when.

torch 2.13 splits a stage's backward in two (pipelining/_backward.py). `stage_backward_input` computes the input
gradients with `retain_graph=True` and keeps, for every parameter group, the gradient that arrives at the node where
the weight's path joins the input's (`param_group["grads"]`: each Linear's output gradient, each norm's) until
`stage_backward_weight` consumes it. A chunk between its two passes therefore holds what a chunk in flight holds
(its saved activations, or its checkpoint inputs: the input pass's re-run is gone by its end) plus those gradients
(`pending_grad_bytes`, per block; measured on the CPU with MemTracker: 1.70 MB per d256 GPT block at s 256 under
bf16 autocast, with or without full recompute, against 1.70 predicted), and on the last stage lm_head's and the final
norm's (`head_pending_bytes`).

Each finished input pass whose gradient goes to another rank leaves it alive to the step's end (the stage input's
`.grad`; the send of it is waited only at the step's end, schedules.py `_step_microbatches` l. 2654):
`pipelined_backward.stage_grad_bytes` per input pass done. A V schedule's stage p hands its input gradient to stage
p - 1 on the same rank instead (`set_local_bwd_input`), where it takes the place of a receive buffer the model counts
already (the per-action census of the toy ZBV last rank: stage p - 1's next input pass frees the buffer it replaced),
so those passes are not counted. The census shows two boundary-sized fp32 tensors per finished input pass (the other
a residual-stream sum made in the pass); counting one brings the zero-bubble and ZBV none / full rows of the traced
fixture within 3%, counting two overshoots by up to 6%, so one is counted and the other is unexplained.

When: a rank's action list reaches points (chunks held, chunks between their passes, input passes done, and how many
of the held chunks are its lowest stage's). Their frontier over (held, pending), each with the most of the others
there, in closed form for torch 2.13's plans (`_calculate_single_rank_operations`;
tests/unit/test_split_backward.py checks it against them for pp 2-8, v 2-3 and several microbatch counts), on
pipeline rank r of p with m microbatches (`FrontierPoint`):
- zero bubble (looped, v chunks): (in_flight, r + 1), done (v or, on rank 0, v - 1) x (m - p) + r + 1, all of them
  on the lowest stage up to m and 2p;
- ZBV: (2p, 1) and (p + r, 2r + 1) at m >= 2p: the later ranks drain their V's second leg while their first leg
  waits; with fewer microbatches (m = p is the fewest a spec allows) the rank holds m + r + 1 at most (the closed
  forms in `frontier` reduce to these at m >= 2p);
- DualPipeV: (2p + 1, 0), (2p, 1) (not on the last rank) and (p, r + 1); only its few input passes count as done
  (its full backwards' input gradients are not: the 7B trace keeps none of the middle ranks').
The rank's moments are priced at `in_flight` chunks held, as many on the lowest stage as at the rank's most
(pipeline_activations.py `peak_lowest`; with the layers split unevenly that stage has the most blocks);
`split_backward_bytes(...).pending` is what the frontier adds to them: the largest change in the held chunks' bytes +
(pending - 1) x pending chunk + (done - 1) x boundary over its points (the input pass that is running is the moment's
own: its gradients are in the backward moment's ledger; a chunk fewer held frees its saved tensors but not its input
on a non-first stage, a receive buffer; a waiting chunk is priced at the larger of the two stages' kinds, since which
one waits varies). Under checkpointing its `weight_pass` is one more candidate: a weight pass re-runs its chunk's
blocks (once: strategies/pp.WeightPassStage) while every chunk between its passes waits.

Under layers:K a weight pass re-runs a chunk's first checkpoint (its K-th block) only after the K - 1 plain blocks
before it have freed their saved tensors (rank_activations.py `weight_pass_rerun`).

DualPipeV's rank 0 at m = 2p reaches its activation peak before its first stage's first backward, so that stage's
gradients are made later (`first_leg_late_grad_bytes`). Its overlapped phase pairs one chunk's forward with the other
chunk's full backward, so those backwards start with as many chunks in flight as the forward left, each one chunk's
(pipelined_backward.py `overlapped`), and on rank 0 with a last-stage chunk's loss graph held
(schedule_backward.py `overlapped_loss_graph`).

Against the engine's full-size trace, every row of tests/fixtures/traced_peaks/split_backward.json is within 3%, and so
is every 7B-shaped ddp x tp8 x pp4 row at world 64 (benchmarks/results/fullest_moment_split.json; DualPipeV under full
recompute: rank 0 -4.69% -> -0.71%, the last rank -3.21% -> -2.08%). On uneven splits (uneven_split.json: 23 of 27
rows within 3%, and a TinyLlama-1.1B shape in the same results file) what is left:
- ZBV's middle and last ranks at -3.2% .. -3.8% without recompute or under selective, zero bubble's rank 1 under
  selective at -3.05%: a running input pass of the lowest stage's chunk keeps that chunk's gradients of the blocks it
  has passed, not priced (pricing them overshoots the even rows by up to 5%);
- full recompute on the 1.1B shape, down to -8.5%: a weight pass keeps each re-run block's tensors it never unpacks
  until the pass ends (strategies/pp.WeightPassStage runs it as one graph task; non-reentrant checkpoint frees a
  recomputed tensor only when it is unpacked). Counted as a block's saved bytes less every Linear's input and the
  norms' saved inputs, less the waiting gradients the pass frees, it matches a CPU microbenchmark of the engine's
  blocks (a d128 block at s 256: 0.944 MiB a block measured against 0.940 for GPT, 1.597 against 1.721 for Llama) and
  brings those rows to -4.0% .. +4.5%, but puts a 22-layer ddp x tp2 x pp2 zero-bubble layout at m = 2 from -2.5% to
  +13%: the weight-pass moment's other terms (a frontier point's counts with every stage's unsharded state; the 1.1B
  DualPipeV rank 1 peaks after its other stage's last weight pass, when FSDP2's replicate has freed that stage's
  unsharded parameters and gradients) are not right enough to add it. Not modelled.

Left out: a MoE block's experts (their grouped matmuls' output gradients: only attention and norms are counted), and
the first stage's own chunk, whose input pass does nothing (its weight pass runs the whole backward): its pending
gradients are counted like the others'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from backend.analytic.layout import Layout, PipelineSchedule
from backend.analytic.memory.activations import LayerShape, linears_of
from backend.analytic.memory.pipeline_activations import (
    held_chunks_bytes,
    in_flight,
    peak_lowest,
    split_backward,
    stage_grad_bytes,
)
from backend.analytic.scalar_or_array import logical_and, logical_or, maximum, minimum, where
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.memory.parts import RankParts
    from backend.analytic.memory.rank_activations import ActivationMoments
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


def pending_grad_bytes(model: ModelSpec, layout: Layout, shape: LayerShape) -> Num:
    """One block's gradients kept from its input pass to its weight pass: every Linear's local output gradient
    (columnwise ones split over tp, the rowwise o and fc_out / down whole: their partial sums) in the dtype the
    Linear computes in, and both norms' output gradients (fp32 under autocast, which runs norms in fp32; over the
    sequence-parallel shard under SP). `shape`: block 0's kind at tp 1 (LayerShape.prototype)."""
    widths = [w for w, _ in linears_of(shape)]
    rowwise = widths[3] + (widths[-1] if len(widths) > 4 else 0)  # o, and the MLP's last Linear
    columnwise = sum(widths) - rowwise
    rows = layout.micro_batch * layout.seq_local(model)
    linears = rows * (columnwise / layout.tp + rowwise) * layout.compute_bytes
    return linears + 2 * stage_grad_bytes(model, layout)  # each norm's output gradient is residual-stream sized


def head_pending_bytes(model: ModelSpec, layout: Layout) -> Num:
    """A last-stage chunk's gradients beyond its blocks' from its input pass to its weight pass: lm_head's local output
    gradient (the logits' (b, s, V/tp) in the dtype it computes in) and the final norm's. On the rank with the last
    stage every chunk waiting at the frontier's points is a last-stage chunk (torch's plans: zero bubble's p of them on
    rank p - 1, ZBV's and DualPipeV's one on rank 0)."""
    rows = layout.micro_batch * layout.seq_local(model)
    logits = rows * model.vocab_size / layout.tp * layout.compute_bytes
    return logits + stage_grad_bytes(model, layout)  # the final norm's output gradient


class FrontierPoint(NamedTuple):
    """One point of a rank's frontier (module docstring): chunks held, chunks between their passes, input passes
    done, and how many of the held chunks are its lowest stage's (the most at that point in torch 2.13's plans; that
    stage has the most blocks when the layers split unevenly)."""
    held: Num
    waiting: Num
    done: Num
    held_lowest: Num


def frontier(layout: Layout, pp_rank: Num) -> list[FrontierPoint]:
    """The module docstring's points for the layout's schedule, three per layout (a schedule with fewer repeats its
    first; zero bubble's on the other schedules, whose extra is then masked by `split_backward`). done: the most
    input passes whose gradient goes to another rank finished when the pair is reached."""
    p, m, v, r = layout.pp, layout.microbatches, layout.virtual_stages, pp_rank
    first, last = pp_rank == 0, pp_rank == p - 1
    units = in_flight(layout, pp_rank)
    looped = (units, r + 1, where(first, v - 1, v) * (m - p) + r + 1, minimum(minimum(units, m), 2 * p))
    zbv_top = (units, 1, where(first, maximum(p, m - p + 1), where(last, m - p, maximum(p - r, 2 * m - 3 * p + 2 + r))),
               minimum(2 * p - r, m))
    turn_lowest = minimum(p, m - p + 1)
    turn_held = minimum(p + r, maximum(m - p + 1, r + 2 * m - 3 * p + 2))
    zbv_turn = (turn_held, minimum(turn_held, r + 1 + maximum(turn_held - turn_lowest, 0)),
                where(last, m, where(m < 2 * p, minimum(m + p + r, 2 * m), 2 * m - p + r + 1)), turn_lowest)
    dualpipev = [(2 * p + 1, 0, p - 1 - r, 2 * p - r),
                 (where(last, 2 * p + 1, 2 * p), where(last, 0, 1), p - 1 - r, where(last, p + 1, 2 * p - 1 - r)),
                 (p, r + 1, where(first, p - 1, where(last, (p + 1) // 2, p)), p - (r + 1) // 2)]
    by_schedule = {PipelineSchedule.ZBV: [zbv_top, zbv_turn, zbv_top], PipelineSchedule.DUALPIPEV: dualpipev}
    points = [looped, looped, looped]
    for schedule, theirs in by_schedule.items():
        on = layout.schedule == schedule
        points = [tuple(where(on, a, b) for a, b in zip(mine, prev, strict=True))
                  for mine, prev in zip(theirs, points, strict=True)]
    return [FrontierPoint(*point) for point in points]


@dataclass(frozen=True)
class SplitBackwardBytes:
    """What a split backward adds to a rank's moments (scalars or arrays; 0 on every other schedule)."""
    pending: Num
    """Added to the loss's backward and to the backward moment (which also takes the activation peak plus it: the
    activation category itself, measured at its own peak, leaves the waiting chunks out): the frontier's largest
    (held - in_flight) x chunk + (pending - 1) x pending chunk + (done - 1) x boundary."""
    weight_pass: Num
    """Checkpointed blocks: a weight pass's moment above the rank's held bytes (the frontier's points with a chunk
    waiting, every pending chunk's gradients and every input pass's boundary, plus one block re-run); 0 without
    checkpointing."""


def split_backward_bytes(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts,
                         acts: ActivationMoments) -> SplitBackwardBytes:
    """The module docstring's two terms for one rank (layout fields and pp_rank broadcast together)."""
    shape = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, sac_ops=layout.sac_ops)
    units = in_flight(layout, pp_rank)
    # a chunk fewer held frees its saved tensors, but not its input on a non-first stage: a receive buffer
    inputs = stage_grad_bytes(model, layout) * (layout.virtual_stages - parts.stages.first) / layout.virtual_stages

    stages = parts.stages
    at_units = held_chunks_bytes(layout, stages, acts.blocks, units, peak_lowest(layout, stages, pp_rank, units))

    def fewer(held: Num, lowest: Num) -> Num:
        """What `held` chunks (`lowest` of them the lowest stage's) hold beyond the `units` the rank's moments are
        priced at (negative when fewer)."""
        return held_chunks_bytes(layout, stages, acts.blocks, held, lowest) - at_units - (held - units) * inputs

    per_block = pending_grad_bytes(model, layout, shape)
    # which stage's chunk waits varies: the larger kind (the last stage is never a rank's lowest: its waiting chunks
    # keep the head's gradients too)
    waiting_chunk = maximum(stages.n_lowest * per_block,
                            (stages.n_blocks - stages.n_lowest) / maximum(layout.virtual_stages - 1, 1) * per_block
                            + where(stages.last, head_pending_bytes(model, layout), 0.0))

    per_done = stage_grad_bytes(model, layout)  # one per input pass done: the module docstring says why one
    pending = weight_pass = 0.0
    for point in frontier(layout, pp_rank):
        held = fewer(point.held, minimum(point.held_lowest, point.held - stages.last))
        # the input pass that is running is the moment's own (its gradients are in the backward's ledger)
        others = maximum(point.waiting - 1, 0) * waiting_chunk
        pending = maximum(pending, held + others + maximum(point.done - 1, 0) * per_done)
        weight_pass = maximum(weight_pass, where(point.waiting > 0, held + point.waiting * waiting_chunk
                                                 + point.done * per_done, 0.0))
    split = split_backward(layout)
    return SplitBackwardBytes(pending=where(split, pending, 0.0),
                              weight_pass=where(logical_and(split, acts.weight_pass_rerun > 0),
                                                weight_pass + acts.weight_pass_rerun, 0.0))


def first_leg_late_grad_bytes(layout: Layout, pp_rank: Num, parts: RankParts) -> Num:
    """Gradients a rank's first-leg stage (its lowest, stage pp_rank) makes only after the rank's activation peak:
    DualPipeV's rank 0 at m = 2p microbatches, and every ZBV rank at m = p, hold their most chunks only before that
    stage's first backward (torch 2.13's action lists; more microbatches reach that count again after it:
    tests/unit/test_split_backward.py). So the gradients that stage accumulates during the step (FSDP2 replicate's
    unsharded ones, fp32) are not there at the activation peak nor at the start of the loss's backward; they are at
    the moments inside backward and at optimizer.step. 0 elsewhere."""
    dualpipev = logical_and(layout.schedule == PipelineSchedule.DUALPIPEV, pp_rank == 0,
                            layout.microbatches == 2 * layout.pp)
    zbv = logical_and(layout.schedule == PipelineSchedule.ZBV, layout.microbatches == layout.pp)
    once = logical_and(layout.pipelined, logical_or(dualpipev, zbv))
    accumulating = logical_and(layout.uses_replicate, layout.microbatches > 1)
    block = parts.last_block.unsharded_grad_numel - parts.last_block.ep_expert_numel
    numel = parts.stages.n_lowest * block + parts.stages.first * parts.embeddings.unsharded_grad_numel
    return where(logical_and(once, accumulating), MASTER_BYTES * numel, 0)
