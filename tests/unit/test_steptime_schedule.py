"""steptime.schedule.makespan (one pass over a cached dependency order) equals the event simulation it replaced
(kept below verbatim as the reference) to the bit, over schedules, p, v, m, uneven stage costs and p2p."""

from __future__ import annotations

import random

import pytest

from backend.analytic.steptime.schedule import makespan, makespan_pair, rank_order


def reference_makespan(schedule, *, p, v, m, fwd_s, bwd_s, p2p_s=0.0):
    """The repeated-sweep event simulation (schedule.py before the one-pass rewrite)."""
    n_stages = p * v
    orders = [rank_order(schedule, p, v, m, r) for r in range(p)]
    f_done, b_done = {}, {}
    nxt, free, busy = [0] * p, [0.0] * p, [0.0] * p
    f_count, b_count = [0] * n_stages, [0] * n_stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                s, kind = orders[r][nxt[r]]
                if kind == "F":
                    k = f_count[s]
                    dep = 0.0 if s == 0 else f_done.get((s - 1, k))
                    if dep is None:
                        break
                    start = max(free[r], dep + (p2p_s if s > 0 else 0.0))
                    end = start + fwd_s[s]
                    f_done[(s, k)], f_count[s] = end, k + 1
                else:
                    k = b_count[s]
                    own = f_done.get((s, k))
                    dep = own if s == n_stages - 1 else b_done.get((s + 1, k))
                    if own is None or dep is None:
                        break
                    start = max(free[r], own, dep + (p2p_s if s < n_stages - 1 else 0.0))
                    end = start + bwd_s[s]
                    b_done[(s, k)], b_count[s] = end, k + 1
                busy[r] += end - start
                free[r] = end
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("deadlock")
    return max(free), busy


def _grid():
    for schedule in ("gpipe", "1f1b"):
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 5, 8, 16):
                yield schedule, p, 1, m
    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p, 4 * p + p):  # interleaved 1F1B needs m % p == 0 (torch)
                yield "interleaved_1f1b", p, v, m


@pytest.mark.parametrize("schedule,p,v,m", list(_grid()))
def test_makespan_equals_reference(schedule, p, v, m):
    rng = random.Random(hash((schedule, p, v, m)) & 0xFFFF)
    for p2p in (0.0, 0.0, 0.37, rng.uniform(0.0, 2.0)):
        fwd = [rng.uniform(0.1, 3.0) for _ in range(p * v)]
        bwd = [rng.uniform(0.2, 6.0) for _ in range(p * v)]
        assert makespan(schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=p2p) == reference_makespan(
            schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=p2p)


@pytest.mark.parametrize("schedule,p,v,m", list(_grid())[::3])
def test_makespan_pair_is_makespan_twice(schedule, p, v, m):
    rng = random.Random(m * 31 + p)
    fwd = [rng.uniform(0.1, 3.0) for _ in range(p * v)]
    bwd = [rng.uniform(0.2, 6.0) for _ in range(p * v)]
    hop = rng.uniform(0.01, 2.0)
    span0, busy = reference_makespan(schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd)
    span1, _ = reference_makespan(schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=hop)
    assert makespan_pair(schedule, p=p, v=v, m=m, fwd_s=fwd, bwd_s=bwd, p2p_s=hop) == (span0, busy, span1)
