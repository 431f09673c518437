"""Pipeline makespan from each rank's real action order (pure Python).

The analytic bubble (pipeline.py: (p-1)/m for 1F1B, (p-1)/(v·m) interleaved, Narayanan 2021 Sec 2.2)
assumes equal stages and m divisible by p. Here every rank runs its actions in torch's order
(pipelining.interleaved_order rebuilds ScheduleInterleaved1F1B's; GPipe = all F then all B, Huang 2019
Sec 2.3; 1F1B = PipeDream-Flush warm-up of p-1-rank forwards, Narayanan 2021 Sec 2.2.1) and each action
starts when its rank is free and its input is ready: F(s, k) after F(s-1, k); B(s, k) after F(s, k) and
B(s+1, k). Stage costs may differ (uneven layer split, embedding / head stages).
"""

from __future__ import annotations

from functools import lru_cache

from backend.analytic.pipelining import interleaved_order
from backend.analytic.steptime.schedule_levels import LEVELLED, PlanColumns, levelled_plan

SIMULATED = ("gpipe", "1f1b", "interleaved_1f1b")


def rank_order(schedule: str, p: int, v: int, m: int, rank: int) -> list[tuple[int, str]]:
    """(stage, "F" | "B") actions of pipeline rank `rank` in execution order."""
    if schedule == "gpipe":
        return [(rank, "F")] * m + [(rank, "B")] * m
    if schedule == "1f1b":
        warm = min(m, p - 1 - rank)
        out = [(rank, "F")] * warm
        for _ in range(m - warm):
            out += [(rank, "F"), (rank, "B")]
        return out + [(rank, "B")] * warm
    if schedule == "interleaved_1f1b":
        return interleaved_order(p, v, m, rank)
    raise ValueError(f"no action order for schedule {schedule!r}; simulated: {SIMULATED}")


@lru_cache(maxsize=256)
def _action_plan(schedule: str, p: int, v: int, m: int) -> PlanColumns:
    """Every action of one step in a dependency-respecting order, as columns (rank, stage, is_forward, dep, own, hop):
    `dep` is the index of the action it waits for across stages (F(s-1, k) / B(s+1, k); -1: none), `own` the index of
    F(s, k) for a backward, `hop` whether the wait crosses a stage boundary (pays p2p). The order is the one a
    round-robin over ranks, each running its actions until one is not ready, visits them in; readiness depends on
    the action orders only, not on the costs, so it is computed once per (schedule, p, v, m). GPipe and 1F1B: in
    level order instead (schedule_levels.py: the same makespans, built on arrays)."""
    if v == 1 and schedule in LEVELLED and (levelled := levelled_plan(schedule, p, m)) is not None:
        return levelled
    n_stages = p * v
    orders = [[(s, kind == "F") for s, kind in rank_order(schedule, p, v, m, r)] for r in range(p)]
    f_at: list[list[int]] = [[] for _ in range(n_stages)]  # f_at[s][k]: the index of F(s, k) once placed
    b_at: list[list[int]] = [[] for _ in range(n_stages)]
    nxt = [0] * p
    out: list[tuple[int, int, bool, int, int, bool]] = []
    remaining = sum(len(o) for o in orders)
    last = n_stages - 1
    while remaining:
        progressed = False
        for r in range(p):
            order, i = orders[r], nxt[r]
            while i < len(order):
                s, forward = order[i]
                if forward:
                    done = f_at[s]
                    k = len(done)
                    if s == 0:
                        dep = -1
                    elif k < len(f_at[s - 1]):
                        dep = f_at[s - 1][k]
                    else:
                        break
                    done.append(len(out))
                    out.append((r, s, True, dep, -1, s > 0))
                else:
                    done = b_at[s]
                    k = len(done)
                    if k >= len(f_at[s]):
                        break
                    own = f_at[s][k]
                    if s == last:
                        dep = own
                    elif k < len(b_at[s + 1]):
                        dep = b_at[s + 1][k]
                    else:
                        break
                    done.append(len(out))
                    out.append((r, s, False, dep, own, s < last))
                i += 1
                remaining -= 1
                progressed = True
            nxt[r] = i
        if not progressed:
            raise RuntimeError(f"{schedule} action order deadlocks for p={p}, v={v}, m={m}")
    r_col, s_col, f_col, dep_col, own_col, hop_col = (list(column) for column in zip(*out, strict=False))
    return r_col, s_col, f_col, dep_col, own_col, hop_col


def makespan(schedule: str, *, p: int, v: int, m: int, fwd_s: list[float], bwd_s: list[float],
             p2p_s: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, busy seconds per rank) of one step; fwd_s / bwd_s per stage (p·v of them), p2p_s per hop.
    Each action starts when its rank is free and its inputs are ready (+ p2p_s when they cross a stage boundary):
    one pass over `_action_plan`'s order."""
    plan = _action_plan(schedule, p, v, m)
    end: list[float] = []
    free = [0.0] * p
    busy = [0.0] * p
    for r, s, is_f, dep, own, hop in zip(*plan, strict=False):  # max() as comparisons, as in makespan_pair
        start = free[r]
        if is_f:
            ready = (0.0 if dep < 0 else end[dep]) + (p2p_s if hop else 0.0)
            if ready > start:
                start = ready
            e = start + fwd_s[s]
        else:
            if end[own] > start:
                start = end[own]
            ready = end[dep] + (p2p_s if hop else 0.0)
            if ready > start:
                start = ready
            e = start + bwd_s[s]
        end.append(e)
        busy[r] += e - start
        free[r] = e
    return max(free), busy


def makespan_pair(schedule: str, *, p: int, v: int, m: int, fwd_s: list[float], bwd_s: list[float],
                  p2p_s: float) -> tuple[float, list[float], float]:
    """(makespan without p2p, busy per rank without p2p, makespan with p2p_s per hop): `makespan` twice, in one pass."""
    plan = _action_plan(schedule, p, v, m)
    end0: list[float] = []
    end1: list[float] = []
    free0, free1, busy = [0.0] * p, [0.0] * p, [0.0] * p
    # max() written out as comparisons (the same value, the first of equals, as max returns): the loop runs once per
    # action, p x m x 2 of them (1F1B on pp 32 with 1,024 microbatches: 65,536)
    for r, s, is_f, dep, own, hop in zip(*plan, strict=False):
        extra = p2p_s if hop else 0.0
        if is_f:
            c = fwd_s[s]
            ready0 = (0.0 if dep < 0 else end0[dep]) + 0.0
            ready1 = (0.0 if dep < 0 else end1[dep]) + extra
            start0 = free0[r]
            if ready0 > start0:
                start0 = ready0
            start1 = free1[r]
            if ready1 > start1:
                start1 = ready1
        else:
            c = bwd_s[s]
            start0 = free0[r]
            if end0[own] > start0:
                start0 = end0[own]
            ready0 = end0[dep] + 0.0
            if ready0 > start0:
                start0 = ready0
            start1 = free1[r]
            if end1[own] > start1:
                start1 = end1[own]
            ready1 = end1[dep] + extra
            if ready1 > start1:
                start1 = ready1
        e0, e1 = start0 + c, start1 + c
        end0.append(e0)
        end1.append(e1)
        busy[r] += e0 - start0
        free0[r], free1[r] = e0, e1
    return max(free0), busy, max(free1)
