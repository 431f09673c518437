"""One rank's predicted memory at the moment the engine compares (backend/bench/memory.py: every MemTracker /
FSDPMemTracker category when activations peak, i.e. the end of the last microbatch's forward, loss included),
for one layout or arrays of them: `rank_memory`. `estimate` calls it once per class of equivalent ranks, the
planner once per pipeline degree on arrays of every candidate layout and every pipeline rank.

- params / grads / optimizer: model_state.py (+ FSDP2's unsharded state at the peak, fsdp_state.py);
- activations: rank_activations.py;
- other: this rank's dp share of the int64 inputs and targets (its cp share of the sequence), each copied to the
  device (OTHER_IS_DP_SLICE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backend.analytic.distributed_optimizer import model_state_bytes as distributed_optimizer_bytes
from backend.analytic.ep_dispatch import dispatcher_buffer_bytes
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.backward_moment import backward_moment_bytes, logits_held
from backend.analytic.memory.fsdp_state import UnshardedAtPeak, unsharded_at_peak
from backend.analytic.memory.model_state import ModelStateBytes, replicated_state, sharded_state
from backend.analytic.memory.optimizer_step import step_temp_bytes_of
from backend.analytic.memory.parts import RankParts, is_mixed, rank_parts
from backend.analytic.memory.pipeline_activations import recv_buffer_bytes
from backend.analytic.memory.pipelined_backward import sent_grad_bytes
from backend.analytic.memory.rank_activations import rank_activation_moments, rank_activation_terms
from backend.analytic.memory.split_backward import first_leg_late_grad_bytes, split_backward_bytes
from backend.analytic.memory.stack_activations import stack_activation_bytes, stack_blocks, stack_loss_backward_extra
from backend.analytic.memory.stack_backward import stack_backward_bytes
from backend.analytic.memory.stack_states import stack_model_state, step_temp_bytes_of_stack
from backend.analytic.scalar_or_array import any_true, as_int, is_array, maximum, per_value, where

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

INDEX_BYTES = 8  # int64 token ids
OTHER_IS_DP_SLICE = True
"""The engine copies only this rank's dp slice of the batch (B/dp rows) to ctx.device before the memory-tracked
step, on the CPU too (strategies/context.local_batch): `other` is that copy, not the global batch (measured on
the CPU at world 2: ddp, zero3 1,024 B = 2 x 4 x 16 x 8; tp 2,048 B = its whole dp share)."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes per category at the activation peak (scalars, or arrays shaped like the layout x position broadcast), and
    the totals at the other moments that can be the rank's fullest."""
    params_bytes: Num
    grads_bytes: Num
    optimizer_bytes: Num
    activations_bytes: Num
    other_bytes: Num
    total_bytes: Num
    parts: RankParts
    loss_backward_bytes: Num = 0
    """At the start of the loss's backward (the end of forward + loss, with log_softmax's backward tensors)."""
    backward_bytes: Num = 0
    """At the fullest moment inside backward (memory/backward_moment.py)."""
    optimizer_temp_bytes: Num = 0
    """optimizer.step's temporaries (memory/optimizer_step.py); the optimizer.step moment is total - activations +
    these + recv_buffer_bytes + late_grads_bytes."""
    recv_buffer_bytes: Num = 0
    """The pipeline stages' receive buffers (pipeline_activations.recv_buffer_bytes): part of activations_bytes, and
    alive through optimizer.step too."""
    late_grads_bytes: Num = 0
    """Gradients made after the activation peak (split_backward.first_leg_late_grad_bytes): not in grads_bytes, alive
    at optimizer.step."""

    @property
    def moments(self) -> tuple[Num, Num, Num, Num]:
        """(activation peak, optimizer.step, start of the loss's backward, inside backward): estimate.RankEstimate's
        `moments`, in its order."""
        return (self.total_bytes,
                self.total_bytes - self.activations_bytes + self.optimizer_temp_bytes + self.recv_buffer_bytes
                + self.late_grads_bytes,
                self.loss_backward_bytes, self.backward_bytes)

    @property
    def fullest_bytes(self) -> Num:
        """The largest of `moments`: what "does it fit" needs before the runtime allowance."""
        a, b, c, d = self.moments
        return maximum(maximum(a, b), maximum(c, d))


def dp_slice_batch_bytes(rows: Any, seq: int) -> Num:
    """This rank's dp share of (inputs, targets), each copied to its own (rows, s) int64 storage on the device."""
    return 2 * rows * seq * INDEX_BYTES


def input_batch_bytes(batch: int, seq: int) -> int:
    """Storage of the engine's int64 (inputs, targets) = tokens[:, :-1], tokens[:, 1:] (backend/engine/data.py):
    two (B, s) copies, except for B = 1 where both slices are already contiguous views of one (1, s+1) tensor."""
    return (seq + 1) * INDEX_BYTES if batch == 1 else 2 * batch * seq * INDEX_BYTES


def model_state(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts,
                unsharded: bool = True) -> ModelStateBytes:
    """FSDP2 layouts through sharded_state, the distributed optimizer (zero1 x tp/pp) through its buckets
    (analytic/distributed_optimizer.py), the others through replicated_state (scalar_or_array.per_value: each on its own
    layouts). unsharded=False: FSDP2 with nothing unsharded (the moments inside backward add their own). A
    non-default stack keeps its own (stack_states.py; unsharded=False there only for memory/state_floor.py: its
    moments keep the unsharded state)."""
    if layout.stack is not None:
        return stack_model_state(model, layout, position, parts, unsharded)

    def state(lay: Layout, pos: RankPosition, prt: RankParts, kind: int) -> tuple[Num, Num, Num]:
        if kind == _SHARDED:
            out = sharded_state(lay, prt, unsharded_at_peak(model, lay, pos.pp_rank, prt) if unsharded
                                else UnshardedAtPeak(0, 0))
        elif kind == _DISTRIBUTED:
            return distributed_optimizer_bytes(lay, prt)
        else:
            out = replicated_state(model, lay, pos, prt)
        return out.params_bytes, out.grads_bytes, out.optimizer_bytes

    kind = where(layout.fsdp, _SHARDED, where(layout.distributed_optimizer, _DISTRIBUTED, _REPLICATED))
    return ModelStateBytes(*per_value(kind, state, layout, position, parts))


_REPLICATED, _SHARDED, _DISTRIBUTED = range(3)


def rank_memory(model: ModelSpec, layout: Layout, position: RankPosition) -> RankMemory:
    """Every category of one rank (`layout` and `position` fields broadcast together: the planner passes
    layout.broadcast() columns and pipeline ranks as a row)."""
    parts = rank_parts(model, layout, position)
    state = model_state(model, layout, position, parts)
    params, grads, optimizer = state.params_bytes, state.grads_bytes, state.optimizer_bytes
    if layout.stack is not None:
        return _stack_rank_memory(model, layout, position, parts, state)
    acts = rank_activation_moments(model, layout, position.pp_rank, parts)
    split = split_backward_bytes(model, layout, position.pp_rank, parts, acts)
    late = first_leg_late_grad_bytes(layout, position.pp_rank, parts)
    grads = grads - late
    activations = acts.peak
    other = other_bytes(model, layout)
    total = params + grads + optimizer + activations + other
    loss = where(parts.stages.last, total - activations + acts.forward_loss + split.pending
                 + loss_backward_extra(model, layout) + sent_grad_bytes(model, layout, parts), 0)
    # nothing is unsharded without FSDP2: the resting state is the state itself (the planner's groups are one flavour
    # family each)
    resting = model_state(model, layout, position, parts, unsharded=False) if any_true(layout.fsdp) else state
    backward = backward_moment_bytes(model, layout, position.pp_rank, parts, acts,
                                     resting.params_bytes + resting.grads_bytes + resting.optimizer_bytes, other)
    # split backward: chunks wait for their weight pass only once backwards have begun, so the activation peak with
    # them is a moment of the backward phase (the activation category, measured at its own peak, leaves them out)
    backward = maximum(maximum(backward, where(split.pending > 0, total, 0)) + split.pending,
                       where(split.weight_pass > 0, total - activations + acts.held + split.weight_pass, 0))
    temp = step_temp_bytes_of(model, layout, position, parts)
    buffers = where(layout.pipelined, recv_buffer_bytes(model, layout, parts), 0)
    return RankMemory(params, grads, optimizer, activations, other, total, parts, as_int(loss), as_int(backward), temp,
                      as_int(buffers), as_int(late))


def other_bytes(model: ModelSpec, layout: Layout) -> Num:
    """The rank's input batch (this dp rank's slice, OTHER_IS_DP_SLICE, or the whole global batch), and the allgather
    dispatcher's gather buffer (ep_dispatch.dispatcher_buffer_bytes; 0 for the other dispatchers)."""
    batch = (dp_slice_batch_bytes(layout.global_batch // layout.dp, layout.seq_local(model)) if OTHER_IS_DP_SLICE
             else input_batch_bytes(layout.global_batch, model.seq_len))
    return batch + dispatcher_buffer_bytes(model, layout)


def _stack_rank_memory(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts,
                       state: ModelStateBytes) -> RankMemory:
    """A non-default stack's moments: its activation peak (stack_activations.py), the start of its loss's backward
    (the activations held plus its loss's own extra), its optimizer step (stack_states.py), and under FSDP2 without
    pipelining the moment inside backward (stack_backward.py)."""
    blocks = stack_blocks(model, layout, position.pp_rank, parts)
    activations = stack_activation_bytes(model, layout, blocks, parts)
    other = other_bytes(model, layout)
    total = state.params_bytes + state.grads_bytes + state.optimizer_bytes + activations + other
    loss = where(parts.stages.last, total + stack_loss_backward_extra(model, layout), 0)
    backward = 0
    if any_true(layout.fsdp):
        rest = stack_model_state(model, layout, position, parts, unsharded=False)
        resting = rest.params_bytes + rest.grads_bytes + rest.optimizer_bytes + other
        backward = stack_backward_bytes(model, layout, parts, resting, blocks)
    temp = _per_distinct_value(lambda opt: step_temp_bytes_of_stack(layout, ModelStateBytes(0, 0, opt)),
                               state.optimizer_bytes)
    return RankMemory(state.params_bytes, state.grads_bytes, state.optimizer_bytes, activations, other, total, parts,
                      as_int(loss), as_int(backward), temp)


def _per_distinct_value(fn: Any, values: Any) -> Num:
    """fn of a scalar, on a scalar or elementwise on an array (once per distinct value)."""
    if not is_array(values):
        return fn(values)
    distinct, at = np.unique(values, return_inverse=True)
    return np.array([fn(v) for v in distinct.tolist()], dtype=np.int64)[at].reshape(np.shape(values))


def loss_backward_extra(model: ModelSpec, layout: Layout) -> Num:
    """activations.loss_backward_extra_bytes on layouts (the logits held by the loop: `logits_held`; the compiled loss:
    Layout.loss_compiled)."""
    held = logits_held(layout)
    n = layout.seq_local(model) * layout.micro_batch * model.vocab_size
    cb = layout.compute_bytes
    if layout.loss_compiled:  # the 16-bit gradient beside the logits the compiled loss saved
        return n * cb
    freed = (0 if cb == 4 else 4 * n) + where(held, 0, n * cb)
    return maximum(0.0, 2 * 4 * n - freed)


def worst_rank_memory(model: ModelSpec, layout: Layout, first_rank_only: bool = False,
                      later_ranks_only: bool = False) -> tuple[Num, Num]:
    """(bytes at its fullest moment, pipeline rank) of each layout's fullest rank: `RankMemory.fullest_bytes`, the
    number `estimate` gives each rank (RankEstimate.fullest_bytes). The worst rank sits at tp index 0 and FSDP dp
    index 0 (torch.chunk gives the first chunks the most rows) and, under ZeRO-1, at the dp index that owns the
    largest optimizer share (the optimizer.step moment: the share with the largest state + temporaries); which
    pipeline rank peaks depends on the schedule, so every one is evaluated: one call per pipeline degree and flavour
    family on (layouts x pipeline ranks) arrays. first_rank_only: pipeline rank 0 alone (the planner's prune: one
    rank's bytes are a lower bound of the worst rank's, at a fraction of the work; exact without pipelining).
    later_ranks_only: pipeline ranks 1.. alone (the planner's second pass, after the first: the larger of the two is
    the worst rank's; a layout without pipelining gets 0 bytes at rank 0)."""
    if not is_array(layout.pp):
        totals = rank_memory(model, layout,
                             RankPosition(pp_rank=np.arange(layout.pp), largest_zero1_share=True)).fullest_bytes
        at = int(np.argmax(totals))
        return int(totals[at]), at
    worst, at = np.zeros(len(layout)), np.zeros(len(layout), dtype=np.int64)
    whole = RankPosition(largest_zero1_share=True)
    rank_parts(model, layout, whole)  # every layout's part sums and block terms at once (memoised per layout):
    rank_activation_terms(model, layout)  # each group below takes its rows of them
    if is_mixed(model):
        rank_activation_terms(model, layout, alt=True)  # the other MLP kind's blocks too
    for pp in np.unique(layout.pp).tolist():
        for fsdp in (False, True):  # one flavour family per call: each computes only its own branch
            rows = np.nonzero((layout.pp == pp) & (layout.fsdp == fsdp))[0]
            if not len(rows):
                continue
            ranks = np.arange(1 if later_ranks_only else 0, 1 if first_rank_only else pp)
            if not len(ranks):
                continue
            totals = rank_memory(model, layout.group(rows),
                                 RankPosition(pp_rank=ranks[None, :], largest_zero1_share=True)).fullest_bytes
            best = np.argmax(totals, axis=1)
            at[rows], worst[rows] = ranks[best], totals[np.arange(len(rows)), best]
    return worst, at
