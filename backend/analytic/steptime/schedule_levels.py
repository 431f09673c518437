"""The action plan of GPipe and 1F1B (one stage per rank) from a closed form of their levels, on arrays (numpy).

schedule.makespan walks a dependency-respecting order of a step's actions: end = max(rank free, input ready (+ p2p
across a stage boundary), own forward) + cost. Every action's value is the same in any order that respects the
dependencies (each rank's actions in its own order), so the plan may list the actions level by level: a level's
actions depend only on earlier levels', and each rank's actions sit on strictly increasing levels. schedule.py
finds its order by a round-robin over the ranks in Python (1F1B at pp 32 with 1,024 microbatches: 65,536 actions,
~0.1 s per (p, m) cold); here the levels are a closed form of schedule.rank_order's orders, sorted on arrays,
checked on every dependency before use (a layering that failed the check returns None: the round-robin then).
tests/unit/test_steptime_schedule.py checks the makespans against the event simulation it replaced, bit for bit.
"""

from __future__ import annotations

import numpy as np

LEVELLED = ("gpipe", "1f1b")
"""Schedules whose levels are built here (virtual_stages == 1)."""
PlanColumns = tuple[list[int], list[int], list[bool], list[int], list[int], list[bool]]
"""An action plan as columns (rank, stage, is_forward, dep, own, hop), one entry per action (zip them to walk it)."""


def _candidate_levels(schedule: str, p: int, m: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(forward levels (p, m), backward levels (p, m), each rank's levels in its action order)."""
    r = np.arange(p)[:, None]
    k = np.arange(m)[None, :]
    if schedule == "gpipe":  # every forward, then every backward, the last stage's first
        fwd = r + k
        bwd = m + 2 * p - 2 - r + k
        return fwd, bwd, [np.concatenate([fwd[i], bwd[i]]) for i in range(p)]
    warm = np.minimum(m, p - 1 - r)  # rank_order's warm-up forwards
    bwd = 2 * p - 1 - r + 2 * k
    steady = np.take_along_axis(bwd, np.maximum(k - warm - 1, 0), axis=1) + 1  # after its previous backward
    fwd = np.where(k <= warm, r + k, steady)
    orders = []
    for i in range(p):
        w = int(warm[i, 0])
        pairs = np.stack([fwd[i, w:], bwd[i, :m - w]], axis=1).reshape(-1)
        orders.append(np.concatenate([fwd[i, :w], pairs, bwd[i, m - w:]]))
    return fwd, bwd, orders


def levelled_plan(schedule: str, p: int, m: int) -> PlanColumns | None:
    """schedule._action_plan's columns (rank, stage, is_forward, dep, own, hop) for GPipe / 1F1B in level order,
    built on arrays; None when the closed form fails its check (a dependency not on an earlier level, or a rank's
    actions not on increasing levels)."""
    fwd, bwd, orders = _candidate_levels(schedule, p, m)
    valid = (fwd[1:] > fwd[:-1]).all() and (bwd[:-1] > bwd[1:]).all() and (bwd > fwd).all() \
        and all((np.diff(o) > 0).all() for o in orders)
    if not valid:
        return None
    n = p * m  # action a < n: F(a // m, a % m); a >= n: B((a - n) // m, a % m)
    order = np.argsort(np.concatenate([fwd.reshape(-1), bwd.reshape(-1)]), kind="stable")
    at = np.empty(2 * n, dtype=np.int64)
    at[order] = np.arange(2 * n)  # each action's index in the plan
    rank, micro = np.divmod(order % n, m)
    is_f = order < n
    f_at = at[:n].reshape(p, m)
    own = np.where(is_f, -1, f_at[rank, micro])
    f_dep = np.where(rank > 0, f_at[np.maximum(rank - 1, 0), micro], -1)
    b_dep = np.where(rank < p - 1, at[n:].reshape(p, m)[np.minimum(rank + 1, p - 1), micro], own)
    dep = np.where(is_f, f_dep, b_dep)
    hop = np.where(is_f, rank > 0, rank < p - 1)
    ranks = rank.tolist()
    return ranks, ranks, is_f.tolist(), dep.tolist(), own.tolist(), hop.tolist()
