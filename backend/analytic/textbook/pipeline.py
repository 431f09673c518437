"""Pipeline-parallel bubble and in-flight activations per stage (pure Python).

One definition throughout: bubble_fraction = idle time / total time of a stage (per step).
bubble_over_ideal = idle time / ideal (bubble-free) time, the ratio Narayanan et al. 2021 report.
They are related by f = x / (1 + x)  (x = bubble_over_ideal, f = bubble_fraction).
p = pipeline ranks, m = microbatches per step, v = model chunks per rank (virtual stages).

Zero-bubble schedules assume the ZB paper's unit costs T_F = T_B = T_W (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", Sec 2): one microbatch costs 3 units on a stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


def _check(schedule: str, p: int, m: int, v: int) -> str:
    schedule = str(schedule)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} not in {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if schedule in ("zbv", "dualpipev") and v != 2:
        raise ValueError(f"{schedule} places exactly 2 chunks per rank (V shape); got v={v}")
    return schedule


def bubble_over_ideal(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """Bubble time / ideal time."""
    schedule = _check(schedule, p, m, v)
    return bubble_formula(schedule, p=p, m=m, v=v)


def bubble_formula(schedule: str, *, p: Num, m: Num, v: Num = 1) -> Num:
    """`bubble_over_ideal` without the checks, elementwise on ints or numpy arrays."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m  # Narayanan 2021 Sec 2.2.1: t_pb / t_id = (p-1)/m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)  # Narayanan 2021 Sec 2.2.2: bubble shrinks by v
    if schedule == "zero_bubble":
        # Qi 2023 Sec 2.1 (ZB-H1, torch's ZB1P): bubble (p-1)(T_F+T_B-T_W) = 1/3 of 1F1B's (p-1)(T_F+T_B+T_W); /v
        # interleaved
        return (p - 1) / (3 * v * m)
    if schedule == "dualpipev":
        # deepseek-ai/DualPipe @ 3da1bbea README, "Pipeline Bubbles and Memory Usage Comparison": DualPipeV's bubble is
        # (PP/2 - 1)(F&B + B - 3W) over PP = 2p stages = (p - 1)(F&B + B - 3W) per stage chunk. torch 2.13's
        # ScheduleDualPipeV runs an OVERLAP_F_B action's forward and backward one after the other (schedules.py
        # l. 2632-2636), so F&B = F + B; in the ZB unit costs (F = W = 1, full backward B = 2, one chunk) that is
        # 2(p - 1), over an ideal of m microbatches x 2 chunks x 3 units: (p - 1) / (3m).
        return (p - 1) / (3 * m) + 0.0 * v
    # Qi 2023 Sec 6 (ZB-V): zero bubble when T_F = T_B = T_W, with 1F1B's peak activation memory
    return 0.0 * p


def bubble_fraction(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """Idle time / total time of a stage: GPipe and 1F1B give (p-1)/(m+p-1) (Huang et al. 2019, GPipe, Sec 2.3)."""
    x = bubble_over_ideal(schedule, p=p, m=m, v=v)
    return x / (1 + x)  # total = ideal + bubble, so idle/total = x/(1+x)


def pipeline_utilisation(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """Busy time / total time = 1 - bubble_fraction; m/(m+p-1) for GPipe and 1F1B."""
    return 1.0 - bubble_fraction(schedule, p=p, m=m, v=v)


def in_flight_microbatches(schedule: str, *, p: int, m: int, stage: int, v: int = 1) -> int:
    """Peak number of (microbatch, chunk) forward activations rank `stage` (0-based) holds at once.

    Counted as forwards whose (weight-)backward has not run yet; the interleaved and zero-bubble counts
    match the action lists torch.distributed.pipelining builds (tests/unit/test_analytic_formulas.py).

    For v = 1 this is whole-stage microbatches; for v > 1 each unit is one chunk (1/v of the rank's
    layers): divide by v for whole-rank microbatch equivalents (see `in_flight_stage_activations`).
    """
    schedule = _check(schedule, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in [0, {p}), got {stage}")
    return int(in_flight_formula(schedule, p=p, m=m, stage=stage, v=v))


def _minimum(a: Num, b: Num) -> Num:
    """min(a, b) elementwise for ints and numpy int arrays alike (this module stays numpy-free)."""
    return b + (a - b) * (a < b)


def in_flight_terms(schedule: str, *, p: Num, m: Num, v: Num = 1) -> tuple[Num, Num, Num]:
    """(cap, base, per_stage): rank `stage` holds min(cap, base + per_stage · (p - stage)) forwards at its peak
    (ints or numpy int arrays; the stage enters only through p - stage)."""
    if schedule == "gpipe":
        return m, m + 0 * p, 0  # Huang 2019 Sec 2.3: all m forwards finish before the first backward
    if schedule == "1f1b":
        return m, 0 * m, 1  # Narayanan 2021 Sec 2.2.1 (PipeDream-Flush): warm-up of p - stage forwards
    # m // max(1, m // p): microbatches per round as torch.distributed.pipelining counts them (= p when p | m)
    per_round = m // (m // p + (1 - m // p) * (m // p < 1))
    if schedule == "interleaved_1f1b":
        # Narayanan 2021 Sec 2.2.2 (Megatron-LM, torch): warm-up (v-1)·p + 2(p-stage-1) chunk forwards, +1 in 1F1B
        return m * v, (v - 1) * per_round - 1, 2
    if schedule == "zero_bubble":
        # Qi 2023 Sec 2.1 (ZB-H1 peak = 1F1B's first stage, p): warm-up (v-1)·p + (p-stage-1), W deferred by `stage`
        return m * v, (v - 1) * per_round + p, 0
    if schedule == "dualpipev":
        # DualPipe README: PP + 1 = 2p + 1 stage chunks in flight per device, as torch's ScheduleDualPipeV action
        # lists give on every rank (tests/unit/test_analytic_formulas.py)
        return m * v, p * v + 1, 0
    # Qi 2023 Sec 6 (ZB-V): every rank peaks at 1F1B's first-stage memory, p whole-rank microbatches = 2p chunks;
    # with fewer than 2p microbatches torch's ScheduleZBVZeroBubble holds m + stage + 1 (its action lists:
    # tests/unit/test_analytic_formulas.py)
    return p * v, m + p + 1, -1


def in_flight_formula(schedule: str, *, p: Num, m: Num, stage: Num, v: Num = 1) -> Num:
    """`in_flight_microbatches` without the checks, elementwise on ints or numpy int arrays."""
    cap, base, per_stage = in_flight_terms(schedule, p=p, m=m, v=v)
    return _minimum(cap, base + per_stage * (p - stage))


def in_flight_stage_activations(schedule: str, *, p: int, m: int, stage: int, v: int = 1) -> float:
    """Peak activations held by a rank in units of one microbatch through ALL its layers.

    Interleaved on stage 0: p + (p-1)/v = p(1 + (p-1)/(pv)) (Korthikanti et al. 2022 Sec 4.2.3).
    """
    return in_flight_microbatches(schedule, p=p, m=m, stage=stage, v=v) / v


def last_stage_in_flight(schedule: str, *, m: int) -> int:
    """Microbatches whose loss graph (logits, log-probs) the last stage holds at once: GPipe runs every
    forward + loss before the first backward (Huang 2019 Sec 2.3); the 1F1B family runs the last stage's
    backward right after its forward (Narayanan 2021 Sec 2.2.1; torch's plans give the last stage one warm-up)."""
    return m if str(schedule) == "gpipe" else 1
