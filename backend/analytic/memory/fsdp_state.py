"""FSDP2 / replicate state at the engine's activation peak beyond the sharded storage: which units are unsharded
and which unsharded gradients have accumulated, depending on where the peak falls (inside the root's forward, at
a pipeline stage's forward or backward, per local stage of an interleaved rank). One layout or arrays of them.

- Without pipelining (`head_peak`): the peak is inside the root's forward when the last MoE block's dispatch
  buffers (ep) or its grouped experts' stacked weights (memory/expert_casts.py) outweigh the head and loss ("block"),
  or when lm_head's fp32 logits all-gather holds more than the loss adds (tp, "root"); otherwise after the root's
  forward (the loss), where zero3 holds nothing unsharded.
- gpipe / 1f1b stages (`pipeline_peak_state`): torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`
  keeps units unsharded after every backward (reshard_after_backward=False) and accumulates unsharded gradients
  (requires_gradient_sync=False) until `perform_reduce_grad` after the last one.
- interleaved 1F1B ranks (`interleaved_peak_states`): per local stage, in closed form; `multi_stage_peak` walks
  torch's action order and is the definition the closed form is tested against.
Inside a forward the peak holds the last block's flat all-gather output when that forward gathered
(_fsdp_param_group.py wait_for_unshard), and under zero3 the root and (inside it) the last block unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.layout import Layout, PipelineSchedule, ZeroStage
from backend.analytic.memory.activations import LayerShape, dispatch_outweighs_head, head_beyond_blocks_bytes
from backend.analytic.memory.expert_casts import grouped_outweighs_head
from backend.analytic.memory.parts import RankParts
from backend.analytic.pipelining import interleaved_order
from backend.analytic.scalar_or_array import (
    any_true,
    logical_and,
    logical_not,
    logical_or,
    minimum,
    per_distinct,
    take_rows,
    where,
)
from backend.analytic.sharding import layer_split

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ModelSpec


@dataclass(frozen=True)
class HeadPeak:
    """Where the peak of the stage with the logits falls when inside its forward (scalars or arrays)."""
    in_block: Num
    """Inside the last MoE block (ep: its all_to_all dispatch buffers, grouped GEMMs: its stacked expert weights
    outweigh the head and loss)."""
    in_root: Num
    """In the root after the last block (tp, fp32 logits: lm_head's all-gather)."""


def head_peak(model: ModelSpec, layout: Layout) -> HeadPeak:
    in_block = False
    if model.is_moe:
        proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device)
        outweighs = per_distinct(lambda b, tp, sp, ac, cp: dispatch_outweighs_head(model, replace(
            proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=bool(ac), ep=2,
            seq_len=proto.seq_len // cp)), layout.micro_batch, layout.tp, layout.sequence_parallel,
                                 layout.uses_autocast, layout.cp)
        in_block = logical_or(logical_and(layout.ep > 1, outweighs != 0),
                              grouped_outweighs_head(model, layout, _head_beyond(model, layout)))
    in_root = logical_and(logical_not(in_block), layout.tp > 1, layout.compute_bytes == 4)
    return HeadPeak(in_block, in_root)


def _head_beyond(model: ModelSpec, layout: Layout) -> Num:
    """activations.head_beyond_blocks_bytes of every layout, once per distinct micro-batch, tp, SP, autocast and cp."""
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device)
    return per_distinct(lambda b, tp, sp, ac, cp: head_beyond_blocks_bytes(sp=bool(sp), **replace(
        proto, micro_batch=b, tp=tp, autocast=bool(ac), seq_len=proto.seq_len // cp).head_kwargs(model.vocab_size)),
        layout.micro_batch, layout.tp, layout.sequence_parallel, layout.uses_autocast, layout.cp)


@dataclass(frozen=True)
class PipelinePeakState:
    """FSDP2 state of a gpipe / 1f1b pipeline rank (one stage) at its activation peak (scalars or arrays)."""
    applies: Num
    in_block: Num
    """The peak is inside the stage's last block's forward (zero3: the stage root and that block unsharded)."""
    in_root: Num
    """In the root after the last block (the last stage, as `head_peak`)."""
    gathered: Num
    """That forward all-gathered: the last block's flat all-gather output is still referenced too."""
    after_backward: Num
    """A backward of this step ran before: unsharded gradients accumulate (no sync until the last one)."""


def pipeline_peak_state(model: ModelSpec, layout: Layout, pp_rank: Num, last_stage: Num) -> PipelinePeakState:
    """Last stage: the peak is the start of a backward (loss seed made, every in-flight forward held): under 1F1B
    each backward starts with one microbatch in flight and the last such moment (after m-1 backwards) is the one
    the engine keeps; under GPipe the first backward; where `head_peak` places it inside the forward, inside that
    (last) forward instead. Other stages: inside the last block of the LAST forward that reaches the warm-up's
    in-flight count (1F1B: min(m, p - stage), GPipe: m). Under 1F1B with m above that count it is a steady-state
    forward after a backward (units still unsharded, nothing gathered, accumulated grads held); otherwise the last
    warm-up forward, which all-gathered under zero3. zero2 gathers only in a stage's first forward."""
    sched, mb, zero2 = layout.schedule, layout.microbatches, layout.zero_stage == ZeroStage.ZERO2
    one_f_one_b = sched == PipelineSchedule.ONE_F_ONE_B
    applies = logical_and(layout.pipelined, layout.fsdp, logical_or(one_f_one_b, sched == PipelineSchedule.GPIPE),
                          layout.virtual_stages == 1)
    head = head_peak(model, layout)
    after_last = logical_and(one_f_one_b, mb > 1)
    gathered_last = logical_and(logical_or(head.in_block, head.in_root), where(zero2, mb == 1, logical_not(after_last)))
    warm = where(sched == PipelineSchedule.GPIPE, mb, minimum(mb, layout.pp - pp_rank))
    steady = logical_and(one_f_one_b, mb > warm)
    first_forward = logical_and(logical_not(steady), warm == 1)
    return PipelinePeakState(
        applies=applies,
        in_block=logical_and(applies, where(last_stage, head.in_block, where(zero2, first_forward, True))),
        in_root=logical_and(applies, last_stage, head.in_root),
        gathered=logical_and(applies,
                             where(last_stage, gathered_last, where(zero2, first_forward, logical_not(steady)))),
        after_backward=logical_and(applies, where(last_stage, after_last, steady)))


def _last_in(upper: int, per_round: int, v: int, chunk: int) -> int:
    """The largest i <= upper with (i // per_round) % v == chunk, -1 if none."""
    if upper < 0:
        return -1
    q = upper // per_round
    q2 = q - (q - chunk) % v
    return -1 if q2 < 0 else upper if q2 == q else q2 * per_round + per_round - 1


def interleaved_peak_states(p: int, v: int, m: int, rank: int,
                            zero: int = 3) -> dict[int, tuple[bool, bool, bool, bool]]:
    """`multi_stage_peak`'s {stage: (unsharded, grads, in_forward, gathered)} in closed form (tests: equal on a
    grid). In `interleaved_order` the peak is always the rank's last forward (op m·v - 1: the in-flight count is
    warm-up + 1 at every steady-state forward, the warm-up's at its last); before it run every earlier forward and
    the backwards of steady ops warm-up .. m·v - 2. A stage is unsharded when its latest action is a backward. The
    peak forward's stage, unless it is the last stage, is inside that forward: zero3 gathered unless a backward left
    its units unsharded, zero2 only if it is the stage's first action."""
    out = {}
    for stage, unsharded, grads, in_forward, untouched in _interleaved_walk(p, v, m, rank):
        if in_forward:
            out[stage] = (False, grads, True, untouched if zero == 2 else not unsharded)
        else:
            out[stage] = (unsharded, grads, False, False)
    return out


@lru_cache(maxsize=65536)
def _interleaved_walk(p: int, v: int, m: int, rank: int) -> tuple[tuple[int, bool, bool, bool, bool], ...]:
    """Per local stage: (stage, latest action a backward, a backward ran, the peak is inside its forward, no action
    ran before the peak), from the closed form of `interleaved_peak_states`."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady, peak = m * v - warm, m * v - 1
    at = (peak // per_round) % v
    with_peak = at == v - 1 and rank == p - 1  # the last stage counts after its forward
    pos_f = lambda i: i if i < warm else 2 * i - warm  # noqa: E731  position in the action list
    out = []
    for c in range(v):
        f = _last_in(peak if with_peak else peak - 1, per_round, v, c)
        jb = _last_in(steady - 2, per_round, v, v - 1 - c)
        b = warm + jb if jb >= 0 else -1
        unsh = b >= 0 and (f < 0 or 2 * b - warm + 1 > pos_f(f))
        out.append((c * p + rank, unsh, b >= 0, c == at and not with_peak, f < 0 and b < 0))
    return tuple(out)


@lru_cache(maxsize=65536)
def interleaved_rank_counts(pp: int, v: int, mb: int, zero: int, rank: int, n_layers: int) -> tuple[int, ...]:
    """One interleaved rank's FSDP2 peak state as counts: (blocks unsharded, root unsharded, blocks with grads,
    embeddings with grads, head with grads, last blocks alive in the peak forward, embedding roots unsharded in
    the peak forward)."""
    states = interleaved_peak_states(pp, v, mb, rank, zero)
    stages = sorted(states)
    split = layer_split(n_layers, pp * v)
    last = pp * v - 1
    root = 0 if 0 in stages else last if last in stages else None
    forward = [s for s in stages if states[s][2]]
    zero3 = zero != ZeroStage.ZERO2
    # its gather output + (zero3) the block
    forward_blocks = sum(int(states[s][3]) + zero3 for s in forward if len(split[s]))
    # zero3: the stage root (embeddings; never the last stage here)
    forward_root = sum(zero3 for s in forward if s == 0)
    return (sum(len(split[s]) for s in stages if states[s][0]), root is not None and states[root][0],
            sum(len(split[s]) for s in stages if states[s][1]), 0 in stages and states[0][1],
            last in stages and states[last][1], forward_blocks, forward_root)


@dataclass(frozen=True)
class UnshardedAtPeak:
    """Elements alive at the activation peak beyond the FSDP2 shards (scalars or arrays)."""
    params_numel: Num
    grads_numel: Num


def unsharded_at_peak(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts) -> UnshardedAtPeak:
    """Every unit is unsharded under zero2; under zero3 none once the root's forward ended. Inside a forward
    (`head_peak` without pipelining, `pipeline_peak_state`, or an interleaved rank's peak forward) the last block's
    gather output, and under zero3 the root and the last block, are added. ep experts are FSDP2 ignored_params."""
    zero2, zero3 = layout.zero_stage == ZeroStage.ZERO2, layout.zero_stage == ZeroStage.ZERO3
    stages = parts.stages
    block_unsh, emb_unsh, head_unsh = (p.fsdp_unsharded_numel for p in (parts.last_block, parts.embeddings, parts.head))
    all_unsh = parts.total("fsdp_unsharded_numel")
    root_unsh = stages.first * emb_unsh + stages.last * head_unsh
    last_block = where(stages.n_blocks > 0, block_unsh, 0)

    def forward_peak(in_block: Num, gathered: Num) -> Num:
        """Unsharded elements beyond zero2's when the peak is inside the forward of the rank's units."""
        return where(gathered, last_block, 0) + where(zero3, root_unsh + where(in_block, last_block, 0), 0)

    params = where(zero2, all_unsh, 0)
    head = head_peak(model, layout)
    alone = logical_not(layout.pipelined)
    inside = logical_and(alone, logical_or(head.in_block, head.in_root))
    params = params + where(inside, forward_peak(head.in_block, True), 0)
    pipe = pipeline_peak_state(model, layout, pp_rank, stages.last)
    params = params + where(logical_or(pipe.in_block, pipe.in_root), forward_peak(pipe.in_block, pipe.gathered), 0)
    grads = where(pipe.after_backward, parts.total("fsdp_unsharded_grad_numel"), 0)
    interleaved = logical_and(layout.pipelined, layout.schedule == PipelineSchedule.INTERLEAVED_1F1B,
                              layout.virtual_stages >= 2)

    def state(lay: Layout, rank: Num, prt: RankParts) -> tuple[Num, Num]:
        counts = per_distinct(lambda pp, v, mb, zero, r: interleaved_rank_counts(pp, v, mb, zero, r, model.n_layers),
                              lay.pp, lay.virtual_stages, lay.microbatches, lay.zero_stage, rank)
        blocks_unsh, root_on, blocks_grad, emb_grad, head_grad, fwd_blocks, fwd_root = (
            counts[i] if isinstance(counts, tuple) else counts[..., i] for i in range(7))
        b, e, h = prt.last_block, prt.embeddings, prt.head  # mixed stacks: counted at the last block's kind
        root = prt.stages.first * e.fsdp_unsharded_numel + prt.stages.last * h.fsdp_unsharded_numel
        params_ = where(lay.zero_stage == ZeroStage.ZERO2, prt.total("fsdp_unsharded_numel"),
                        blocks_unsh * b.fsdp_unsharded_numel + root_on * root) \
            + fwd_blocks * b.fsdp_unsharded_numel + fwd_root * e.fsdp_unsharded_numel
        grads_ = blocks_grad * b.fsdp_unsharded_grad_numel + emb_grad * e.fsdp_unsharded_grad_numel \
            + head_grad * h.fsdp_unsharded_grad_numel
        return params_, grads_

    if not any_true(interleaved):
        return UnshardedAtPeak(params, grads)
    if interleaved is True or interleaved.all():
        return UnshardedAtPeak(*state(layout, pp_rank, parts))
    rows = np.nonzero(interleaved.reshape(len(interleaved), -1)[:, 0])[0]
    multi_params, multi_grads = state(layout.take(rows), take_rows(pp_rank, rows, len(interleaved)), parts.take(rows))
    full = np.broadcast_shapes(np.shape(parts.stages.n_blocks), np.shape(interleaved))
    params, grads = np.broadcast_to(params, full).copy(), np.broadcast_to(grads, full).copy()
    params[rows], grads[rows] = multi_params, multi_grads
    return UnshardedAtPeak(params, grads)


# ---- the spec-level views of the same rules (notes, tests) ----

def peak_inside_forward(spec: ExperimentSpec) -> str | None:
    """Where the activation peak of a dp-mix without pipelining falls when inside the FSDP2 root's forward:
    "block", "root", or None (after the root's forward: the loss); None under pipelining."""
    if spec.parallel.pp > 1:
        return None
    head = head_peak(spec.model, Layout.of(spec))
    return "block" if head.in_block else "root" if head.in_root else None


@dataclass(frozen=True)
class PipelinePeak:
    """`pipeline_peak_state` of one rank as a place: where ("block", "root", None), gathered, after_backward."""
    where: str | None
    gathered: bool
    after_backward: bool


def pipeline_peak(spec: ExperimentSpec, stages: list[int]) -> PipelinePeak | None:
    """`pipeline_peak_state` for the rank holding `stages` (None where it does not apply)."""
    layout = Layout.of(spec)
    if len(stages) != 1:
        return None
    state = pipeline_peak_state(spec.model, layout, stages[0] % max(1, layout.pp), stages[0] == layout.n_stages - 1)
    if not state.applies:
        return None
    where_ = "block" if state.in_block else "root" if state.in_root else None
    return PipelinePeak(where_, bool(state.gathered), bool(state.after_backward))


@dataclass(frozen=True)
class StageState:
    """FSDP2 state of one local stage of a multi-stage pipeline rank at its activation peak."""
    unsharded: bool
    """zero3: the stage's units are unsharded (its latest action before the peak was a backward)."""
    grads: bool
    """A backward of this stage ran before the peak: its unsharded gradients are held (no sync until the last)."""
    in_forward: bool = False
    """The peak is inside this stage's forward, in its last block."""
    gathered: bool = False
    """That forward all-gathered."""


def multi_stage_peak(spec: ExperimentSpec, stages: list[int]) -> dict[int, StageState] | None:
    """The definition `interleaved_peak_states` computes in closed form: per local stage of an interleaved-1F1B
    rank, the FSDP2 state at the rank's LAST forward that reaches its maximum in-flight chunk count (every later
    moment holds at least as many sent outputs, `_PipelineScheduleRuntime` keeps every send Work until the step
    ends; ties keep the later moment); on the last stage the start of the backward that follows. A backward
    leaves its units unsharded (stage.py `backward_maybe_with_nosync`: reshard_after_backward=False) until the
    stage's next forward, whose post_forward reshards them (zero3, also on the stage root). A non-last peak
    forward's own stage is inside its last block (all-gathered unless its latest action was a backward); a last
    stage counts after it. It reads `spec.parallel` (pp, zero_stage, pp_schedule, virtual_stages) and
    `spec.train.microbatches` (the planner's test hands it a stand-in with those)."""
    p = spec.parallel
    if p.pp == 1 or p.zero_stage < 2 or str(p.pp_schedule) != "interleaved_1f1b" or len(stages) < 2:
        return None
    rank = stages[0] % p.pp
    order = interleaved_order(p.pp, len(stages), spec.train.microbatches, rank)
    held, counts = 0, []
    for _, kind in order:
        held += 1 if kind == "F" else -1
        counts.append(held if kind == "F" else -1)
    top = max(counts)
    peak = max(i for i, c in enumerate(counts) if c == top)
    at = order[peak][0]
    last_stage = at == p.pp * p.virtual_stages - 1
    before = order[:peak + last_stage]  # last stage: after its forward
    last = {s: k for s, k in before}  # each stage's latest action before the peak
    out = {s: StageState(last.get(s) == "B", (s, "B") in before) for s in stages}
    if not last_stage:  # zero3 gathers unless a backward left the units unsharded; zero2 only in the first forward
        gathered = last.get(at) is None if p.zero_stage == 2 else last.get(at) != "B"
        out[at] = StageState(False, out[at].grads, True, gathered)
    return out

