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
def _action_plan(schedule: str, p: int, v: int, m: int) -> tuple[tuple[int, int, bool, int, int, bool], ...]:
    """Every action of one step in a dependency-respecting order, as (rank, stage, is_forward, dep, own, hop): `dep`
    is the index of the action it waits for across stages (F(s-1, k) / B(s+1, k); -1: none), `own` the index of
    F(s, k) for a backward, `hop` whether the wait crosses a stage boundary (pays p2p). The order is the one a
    round-robin over ranks, each running its actions until one is not ready, visits them in; readiness depends on
    the action orders only, not on the costs, so it is computed once per (schedule, p, v, m)."""
    n_stages = p * v
    orders = [rank_order(schedule, p, v, m, r) for r in range(p)]
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    nxt, f_count, b_count = [0] * p, [0] * n_stages, [0] * n_stages
    out: list[tuple[int, int, bool, int, int, bool]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                s, kind = orders[r][nxt[r]]
                if kind == "F":
                    k = f_count[s]
                    dep = -1 if s == 0 else f_at.get((s - 1, k))
                    if dep is None:
                        break
                    f_at[(s, k)], f_count[s] = len(out), k + 1
                    out.append((r, s, True, dep, -1, s > 0))
                else:
                    k = b_count[s]
                    own = f_at.get((s, k))
                    dep = own if s == n_stages - 1 else b_at.get((s + 1, k))
                    if own is None or dep is None:
                        break
                    b_at[(s, k)], b_count[s] = len(out), k + 1
                    out.append((r, s, False, dep, own, s < n_stages - 1))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} action order deadlocks for p={p}, v={v}, m={m}")
    return tuple(out)


def makespan(schedule: str, *, p: int, v: int, m: int, fwd_s: list[float], bwd_s: list[float],
             p2p_s: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, busy seconds per rank) of one step; fwd_s / bwd_s per stage (p·v of them), p2p_s per hop.
    Each action starts when its rank is free and its inputs are ready (+ p2p_s when they cross a stage boundary):
    one pass over `_action_plan`'s order."""
    plan = _action_plan(schedule, p, v, m)
    end = [0.0] * len(plan)
    free = [0.0] * p
    busy = [0.0] * p
    for i, (r, s, is_f, dep, own, hop) in enumerate(plan):
        if is_f:
            start = max(free[r], (0.0 if dep < 0 else end[dep]) + (p2p_s if hop else 0.0))
            e = start + fwd_s[s]
        else:
            start = max(free[r], end[own], end[dep] + (p2p_s if hop else 0.0))
            e = start + bwd_s[s]
        end[i] = e
        busy[r] += e - start
        free[r] = e
    return max(free), busy


def makespan_pair(schedule: str, *, p: int, v: int, m: int, fwd_s: list[float], bwd_s: list[float],
                  p2p_s: float) -> tuple[float, list[float], float]:
    """(makespan without p2p, busy per rank without p2p, makespan with p2p_s per hop): `makespan` twice, in one pass."""
    plan = _action_plan(schedule, p, v, m)
    end0, end1 = [0.0] * len(plan), [0.0] * len(plan)
    free0, free1, busy = [0.0] * p, [0.0] * p, [0.0] * p
    for i, (r, s, is_f, dep, own, hop) in enumerate(plan):
        if is_f:
            c = fwd_s[s]
            start0 = max(free0[r], (0.0 if dep < 0 else end0[dep]) + 0.0)
            start1 = max(free1[r], (0.0 if dep < 0 else end1[dep]) + (p2p_s if hop else 0.0))
        else:
            c = bwd_s[s]
            start0 = max(free0[r], end0[own], end0[dep] + 0.0)
            start1 = max(free1[r], end1[own], end1[dep] + (p2p_s if hop else 0.0))
        e0, e1 = start0 + c, start1 + c
        end0[i], end1[i] = e0, e1
        busy[r] += e0 - start0
        free0[r], free1[r] = e0, e1
    return max(free0), busy, max(free1)
