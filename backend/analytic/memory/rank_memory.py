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
from typing import Any

import numpy as np

from backend.analytic.distributed_optimizer import model_state_bytes as distributed_optimizer_bytes
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.fsdp_state import unsharded_at_peak
from backend.analytic.memory.model_state import ModelStateBytes, replicated_state, sharded_state
from backend.analytic.memory.parts import RankParts, is_mixed, rank_parts
from backend.analytic.memory.rank_activations import rank_activation_bytes, rank_activation_terms
from backend.analytic.memory.stack_activations import stack_activation_bytes
from backend.analytic.memory.stack_states import stack_model_state
from backend.analytic.vector import is_array, per_value, where

INDEX_BYTES = 8  # int64 token ids
OTHER_IS_DP_SLICE = True
"""The engine copies only this rank's dp slice of the batch (B/dp rows) to ctx.device before the memory-tracked
step, on the CPU too (strategies/context.local_batch): `other` is that copy, not the global batch (measured on
the CPU at world 2: ddp, zero3 1,024 B = 2 x 4 x 16 x 8; tp 2,048 B = its whole dp share)."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes per category (scalars, or arrays shaped like the layout x position broadcast)."""
    params_bytes: Any
    grads_bytes: Any
    optimizer_bytes: Any
    activations_bytes: Any
    other_bytes: Any
    total_bytes: Any
    parts: RankParts


def dp_slice_batch_bytes(rows: Any, seq: int) -> Any:
    """This rank's dp share of (inputs, targets), each copied to its own (rows, s) int64 storage on the device."""
    return 2 * rows * seq * INDEX_BYTES


def input_batch_bytes(batch: int, seq: int) -> int:
    """Storage of the engine's int64 (inputs, targets) = tokens[:, :-1], tokens[:, 1:] (backend/engine/data.py):
    two (B, s) copies, except for B = 1 where both slices are already contiguous views of one (1, s+1) tensor."""
    return (seq + 1) * INDEX_BYTES if batch == 1 else 2 * batch * seq * INDEX_BYTES


def model_state(model: Any, layout: Layout, position: RankPosition, parts: RankParts) -> ModelStateBytes:
    """FSDP2 layouts through sharded_state, the distributed optimizer (zero1 x tp/pp) through its buckets
    (analytic/distributed_optimizer.py), the others through replicated_state (vector.per_value: each on its own
    layouts). A non-default stack keeps its own (stack_states.py)."""
    if layout.stack is not None:
        return stack_model_state(model, layout, position, parts)

    def state(lay: Layout, pos: RankPosition, prt: RankParts, kind: int) -> tuple[Any, Any, Any]:
        if kind == _SHARDED:
            out = sharded_state(lay, prt, unsharded_at_peak(model, lay, pos.pp_rank, prt))
        elif kind == _DISTRIBUTED:
            return distributed_optimizer_bytes(lay, prt)
        else:
            out = replicated_state(model, lay, pos, prt)
        return out.params_bytes, out.grads_bytes, out.optimizer_bytes

    kind = where(layout.fsdp, _SHARDED, where(layout.distributed_optimizer, _DISTRIBUTED, _REPLICATED))
    return ModelStateBytes(*per_value(kind, state, layout, position, parts))


_REPLICATED, _SHARDED, _DISTRIBUTED = range(3)


def rank_memory(model: Any, layout: Layout, position: RankPosition) -> RankMemory:
    """Every category of one rank (`layout` and `position` fields broadcast together: the planner passes
    layout.broadcast() columns and pipeline ranks as a row)."""
    parts = rank_parts(model, layout, position)
    state = model_state(model, layout, position, parts)
    params, grads, optimizer = state.params_bytes, state.grads_bytes, state.optimizer_bytes
    activations = (rank_activation_bytes(model, layout, position.pp_rank, parts) if layout.stack is None
                   else stack_activation_bytes(model, layout, position.pp_rank, parts))
    other = (dp_slice_batch_bytes(layout.global_batch // layout.dp, layout.seq_local(model)) if OTHER_IS_DP_SLICE
             else input_batch_bytes(layout.global_batch, model.seq_len))
    return RankMemory(params, grads, optimizer, activations, other, params + grads + optimizer + activations + other,
                      parts)


def worst_rank_memory(model: Any, layout: Layout) -> tuple[Any, Any]:
    """(total bytes, pipeline rank) of each layout's fullest rank. The worst rank sits at tp index 0 and FSDP dp
    index 0 (torch.chunk gives the first chunks the most rows) and, under ZeRO-1, at the dp index that owns the
    largest optimizer share; which pipeline rank peaks depends on the schedule, so every one is evaluated: one call
    per pipeline degree and flavour family on (layouts x pipeline ranks) arrays."""
    if not is_array(layout.pp):
        totals = rank_memory(model, layout, RankPosition(pp_rank=np.arange(layout.pp), largest_zero1_share=True)).total_bytes
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
            totals = rank_memory(model, layout.group(rows),
                                 RankPosition(pp_rank=np.arange(pp)[None, :], largest_zero1_share=True)).total_bytes
            at[rows] = np.argmax(totals, axis=1)
            worst[rows] = totals[np.arange(len(rows)), at[rows]]
    return worst, at
