"""Measured pipeline bubble from timeline records (pure Python).

Same definition as `backend.analytic.textbook.pipeline.bubble_fraction`: idle time / total time of a stage per
step (Huang et al. 2019, GPipe, Sec 2.3: (p-1)/(m+p-1) for GPipe). "Total time" is the step's pipeline
window on the shared clock, from the first pass on any rank to the last pass on any rank: a rank that
starts late (waiting for the first activation) or finishes early (its backwards done) is idle for that
time, exactly as the textbook counts it. Measuring each rank from its own first to last pass would
hide the ramp-up/ramp-down bubble and under-report it.

Records: {rank, stage, microbatch, pass, start_s, end_s}; pass F, B, W are compute; "wait"/"send"/"recv"
records are idle time and ignored here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from statistics import mean

COMPUTE_PASSES = ("F", "B", "W")


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (a rank running two stages never double-counts overlap)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def per_rank_bubble(records: Iterable[Mapping]) -> dict[int, float]:
    """rank -> 1 - busy_s / window_s, window = global first start .. global last end of compute passes."""
    by_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r["pass"] in COMPUTE_PASSES:
            by_rank[int(r["rank"])].append((float(r["start_s"]), float(r["end_s"])))
    if not by_rank:
        return {}
    start = min(s for iv in by_rank.values() for s, _ in iv)
    end = max(e for iv in by_rank.values() for _, e in iv)
    window = end - start
    if window <= 0:
        return {rank: 0.0 for rank in by_rank}
    return {rank: 1.0 - _busy_s(iv) / window for rank, iv in sorted(by_rank.items())}


def measured_bubble_fraction(records: Iterable[Mapping], reduce: str = "mean") -> float | None:
    """Idle / total time per rank over one step's pipeline window, averaged ("mean") or worst ("max") over
    ranks; None when there are no compute records."""
    per = per_rank_bubble(records)
    if not per:
        return None
    if reduce == "max":
        return max(per.values())
    if reduce != "mean":
        raise ValueError(f"reduce must be 'mean' or 'max', got {reduce!r}")
    return mean(per.values())
