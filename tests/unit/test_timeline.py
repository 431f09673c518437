"""Measured bubble from timeline records: an ideal synthetic schedule reproduces the textbook fraction."""

import pytest

from backend.analytic.measured.bubble_measure import measured_bubble_fraction, per_rank_bubble
from backend.analytic.textbook.pipeline import bubble_fraction


def gpipe_records(p: int, m: int, tf: float = 1.0, tb: float = 2.0) -> list[dict]:
    """Ideal GPipe: stage s runs forward i at (s + i) tf; backwards run in reverse stage order after all forwards."""
    recs = []
    for s in range(p):
        for i in range(m):
            recs.append({"rank": s, "stage": s, "microbatch": i, "pass": "F", "start_s": (s + i) * tf,
                         "end_s": (s + i + 1) * tf})
        t_fwd_done = (m + p - 1) * tf
        for i in range(m):
            start = t_fwd_done + (p - 1 - s + i) * tb
            recs.append({"rank": s, "stage": s, "microbatch": m - 1 - i, "pass": "B", "start_s": start,
                         "end_s": start + tb})
    return recs


def one_f_one_b_records(p: int, m: int, t: float = 1.0) -> list[dict]:
    """Ideal 1F1B with T_F = T_B = t, simulated by dependencies (forward i on s after forward i on s-1,
    backward i on s after backward i on s+1), warm-up of p-s forwards then alternate."""
    done: dict = {}
    free = [0.0] * p
    order = []
    for s in range(p):
        warm = min(m, p - s)
        seq = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            seq.append(("B", b))
            b += 1
            if f < m:
                seq.append(("F", f))
                f += 1
        order.append(seq)
    recs, pos = [], [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] >= len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < p - 1 else \
                ("F", s, i) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0))
            done[(kind, s, i)] = free[s] = start + t
            recs.append({"rank": s, "stage": s, "microbatch": i, "pass": kind, "start_s": start, "end_s": start + t})
            pos[s] += 1
            progressed = True
        assert progressed
    return recs


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_ideal_gpipe_matches_textbook(p, m):
    measured = measured_bubble_fraction(gpipe_records(p, m))
    assert measured == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert measured == pytest.approx(bubble_fraction("gpipe", p=p, m=m), abs=1e-12)
    assert measured_bubble_fraction(gpipe_records(p, m), reduce="max") == pytest.approx(measured)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8)])
def test_ideal_1f1b_matches_textbook(p, m):
    assert measured_bubble_fraction(one_f_one_b_records(p, m)) == pytest.approx(bubble_fraction("1f1b", p=p, m=m),
                                                                                abs=1e-12)


def test_wait_records_are_idle_and_overlaps_count_once():
    recs = [{"rank": 0, "stage": 0, "microbatch": 0, "pass": "F", "start_s": 0.0, "end_s": 2.0},
            {"rank": 0, "stage": 2, "microbatch": 0, "pass": "F", "start_s": 1.0, "end_s": 3.0},
            {"rank": 0, "stage": -1, "microbatch": -1, "pass": "wait", "start_s": 3.0, "end_s": 4.0},
            {"rank": 1, "stage": 1, "microbatch": 0, "pass": "B", "start_s": 3.0, "end_s": 4.0}]
    assert per_rank_bubble(recs) == {0: pytest.approx(0.25), 1: pytest.approx(0.75)}
    assert measured_bubble_fraction(recs, reduce="max") == pytest.approx(0.75)
    assert measured_bubble_fraction([]) is None
    with pytest.raises(ValueError):
        measured_bubble_fraction(recs, reduce="median")
