"""Pipeline makespan from each rank's real action order (pure Python).

The analytic bubble (pipeline.py: (p-1)/m for 1F1B, (p-1)/(v·m) interleaved, Narayanan 2021 Sec 2.2)
assumes equal stages and m divisible by p. Here every rank runs its actions in torch's order
(fsdp_state.interleaved_order rebuilds ScheduleInterleaved1F1B's; GPipe = all F then all B, Huang 2019
Sec 2.3; 1F1B = PipeDream-Flush warm-up of p-1-rank forwards, Narayanan 2021 Sec 2.2.1) and each action
starts when its rank is free and its input is ready: F(s, k) after F(s-1, k); B(s, k) after F(s, k) and
B(s+1, k). Stage costs may differ (uneven layer split, embedding / head stages).
"""

from __future__ import annotations

from backend.analytic.fsdp_state import interleaved_order

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


def makespan(schedule: str, *, p: int, v: int, m: int, fwd_s: list[float], bwd_s: list[float],
             p2p_s: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, busy seconds per rank) of one step; fwd_s / bwd_s per stage (p·v of them), p2p_s per hop."""
    n_stages = p * v
    orders = [rank_order(schedule, p, v, m, r) for r in range(p)]
    f_done: dict[tuple[int, int], float] = {}
    b_done: dict[tuple[int, int], float] = {}
    nxt = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    f_count = [0] * n_stages
    b_count = [0] * n_stages
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
            raise RuntimeError(f"{schedule} action order deadlocks for p={p}, v={v}, m={m}")
    return max(free), busy
