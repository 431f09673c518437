"""A lower bound of each layout's worst-rank memory (rank_memory.worst_rank_memory), cheap on arrays of layouts: the
planner drops the layouts whose bound is over the budget before the full model (and the step-time model) sees them.

The bound is the model's own resting model state (params + grads + optimizer, model_state.model_state with nothing
unsharded) plus the rank's input batch (other_bytes) plus optimizer.step's temporaries (optimizer_step.py; not for a
non-default stack, whose temporaries read its unsharded state), of each pipeline rank at the worst rank's position,
the largest over the pipeline ranks. Why it never exceeds the full model's number: at a pipeline rank, the
optimizer.step moment (RankMemory.moments[1]) = params + grads + optimizer (with FSDP's unsharded state, >= the
resting one) + other + optimizer.step's temporaries (the same ones; a stack's >= 0) >= this rank's bound, and
fullest_bytes is the largest of the moments; the worst rank is the largest over the same pipeline ranks.
tests/unit/test_plan_prune.py checks bound <= worst_rank_memory on every layout of dense, MoE and stack searches.

It is cheap because the resting state does not read the per-layout choices that multiply the layouts: micro-batch
(only whether there is more than one microbatch: `replicate` accumulates gradients then), recompute and sequence
parallel. It is computed once per distinct row of the other columns (STATE_COLUMNS) and spread back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.layout import CHOICES, Layout, RankPosition
from backend.analytic.memory.model_state import ModelStateBytes
from backend.analytic.memory.optimizer_step import step_temp_bytes_of
from backend.analytic.memory.parts import rank_parts
from backend.analytic.memory.rank_memory import model_state, other_bytes

if TYPE_CHECKING:
    from backend.spec import ModelSpec

NOT_IN_STATE = ("micro_batch", "recompute", "recompute_layers", "sequence_parallel")
"""Layout choices the resting model state does not read (memory/model_state.py, distributed_optimizer.py,
stack_states.py, parts.py: the parameters' placement is the degrees', the flavour's and the stages')."""
STATE_COLUMNS = tuple(c for c in CHOICES if c not in NOT_IN_STATE)
STATE_KEY = "state key"
"""Layout.memoised key of the per-layout state key (`_state_key`'s grouping; the planner's enumeration stores its
own from the grid it builds the layouts from: equal exactly where the state columns and "> 1 microbatch" are)."""


def _state_key(layout: Layout) -> np.ndarray:
    """One int per layout, equal for layouts equal on the columns the resting state reads and on whether there is
    more than one microbatch (a mixed-radix code of those columns, each as its dense rank among its values)."""
    key = np.zeros(len(layout), dtype=np.int64)
    for column in [getattr(layout, c) for c in STATE_COLUMNS] + [layout.microbatches > 1]:
        column = np.asarray(column, dtype=np.int64)
        present = np.zeros(int(column.max()) + 1, dtype=bool)
        present[column] = True  # degrees and choices are small non-negative ints: a table, not a sort
        key = key * int(present.sum()) + (np.cumsum(present) - 1)[column]
    return key


def _distinct(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a row of each distinct key, each row's distinct key's index): np.unique's return_index and return_inverse,
    through a table instead of a sort when the keys span a small range."""
    span = int(key.max()) + 1
    if span > 4 * len(key):
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    at = np.empty(span, dtype=np.int64)
    at[key[::-1]] = np.arange(len(key) - 1, -1, -1)  # a row of each key (any serves: the key is its state columns)
    seen = np.zeros(span, dtype=bool)
    seen[key] = True
    keys = np.nonzero(seen)[0]
    index = np.zeros(span, dtype=np.int64)
    index[keys] = np.arange(len(keys))
    return at[keys], index[key]


def state_floor_bytes(model: ModelSpec, layout: Layout) -> np.ndarray:
    """A lower bound of worst_rank_memory(model, layout)[0], layout by layout (arrays of layouts)."""
    floor, _, inverse = state_floor_groups(model, layout)
    return floor[inverse]


def state_floor_groups(model: ModelSpec, layout: Layout) -> tuple[np.ndarray, Layout, np.ndarray]:
    """(the floor of each distinct state, a layout of each (its degrees and flavour are its rows'), each layout's
    distinct state): state_floor_bytes = floor[inverse]; a function of the bytes and the degrees alone (the fit rule)
    is the same on a distinct state as on each of its layouts."""
    first, inverse = _distinct(layout.memoised(STATE_KEY, lambda: _state_key(layout)))
    distinct = layout.take(first)
    floor = np.zeros(len(first))
    for pp in np.unique(distinct.pp).tolist():
        rows = np.nonzero(distinct.pp == pp)[0]
        group = distinct.group(rows)
        position = RankPosition(pp_rank=np.arange(pp)[None, :], largest_zero1_share=True)
        parts = rank_parts(model, group, position)
        state: ModelStateBytes = model_state(model, group, position, parts, unsharded=False)
        resting = state.params_bytes + state.grads_bytes + state.optimizer_bytes + other_bytes(model, group)
        if group.stack is None:  # the optimizer.step moment's own temporaries (a stack's read its unsharded state)
            resting = resting + step_temp_bytes_of(model, group, position, parts)
        floor[rows] = np.broadcast_to(resting, (len(rows), pp)).max(axis=1)
    return floor, distinct, inverse
