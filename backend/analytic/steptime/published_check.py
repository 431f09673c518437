"""The model against every published training run (published_gpu.py's rows), per row and per stack and GPU (pure
Python): how far `estimate` is from what a stack's own recipe measured, so a person can judge the prediction for the
stack they train with before trusting it.

Per row: the predicted step (step_time on the row's spec, the stack and its settings in `spec.train`) beside the
published one; where the source gives a peak memory (torchtitan: max reserved), the predicted fullest moment and the
predicted reserved (fullest + the caching allocator's slack, analytic/device.RuntimeOverhead); and for every row
whether it is predicted to fit the GPU it ran on (analytic/device.fit_verdict). Each row goes through its spec alone,
as `python -m backend estimate --spec ROW.json --hardware HW` prints it: no private knob.

Per stack and GPU: mean and worst |error| of the step, against issue 34's targets (H100: mean <= 8%, worst <= 15%;
peak memory: the fullest moment never above the published peak, the reserved within 10% of it; every recipe fits).
Mixture-of-experts rows (group "... MoE") are summarised apart from the dense ones, as their target is separate.

Nothing here is fitted to these numbers: they are the test. `python -m backend published` prints this, the Formulas
page's "Published runs" tab shows it, benchmarks/published_gpu.py adds the GPU check's own runs and a before column.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from backend.analytic.device import FITS, fit_verdict, runtime_overhead_bytes, with_device
from backend.analytic.estimate import estimate
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import StepTime, step_time
from backend.analytic.steptime.published_gpu import PublishedRow, published_rows
from backend.spec import ExperimentSpec

GIB = 2 ** 30
MOE_SUFFIX = "MoE"
"""The group suffix of mixture-of-experts rows (H100 MoE)."""
TARGET_GROUP = "H100"
STEP_MEAN_TARGET_PCT, STEP_WORST_TARGET_PCT = 8.0, 15.0
"""Issue 34: per stack on H100, mean |error| of the step at most 8%, the worst at most 15%."""
RESERVED_TARGET_PCT = 10.0
"""Issue 34: the predicted reserved within 10% of the published peak reserved."""


def predicted_step(spec: dict, hardware: str) -> StepTime:
    """The row's step time through its spec alone: what `estimate --hardware` prints, with its caveats."""
    return step_time(ExperimentSpec.for_prediction(spec), get_hardware(hardware))


def predicted_step_s(spec: dict, hardware: str) -> float:
    return float(predicted_step(spec, hardware).summary["step_s"])


@dataclass(frozen=True)
class MemoryCheck:
    """One spec's memory on CUDA ranks of a GPU profile, through `estimate` (its fullest rank)."""
    fullest_gib: float
    moment: str
    """The fullest moment's name (RankEstimate.moments)."""
    reserved_gib: float
    """fullest + the allocator's slack (the CUDA context and NCCL buffers are outside torch's reserved memory)."""
    verdict: str
    """analytic/device.fit_verdict on the profile's memory: fits, tight or does not fit."""

    @property
    def fits(self) -> bool:
        return self.verdict == FITS


def memory_check(spec: dict, hardware: str) -> MemoryCheck | None:
    """The spec's memory on `hardware`; None for a profile without a memory size."""
    memory = get_hardware(hardware).memory_bytes
    if not memory:
        return None
    s = with_device(ExperimentSpec.for_prediction(spec), "cuda")
    worst = estimate(s).worst()
    fullest = worst.fullest_bytes()
    moments = worst.moments()
    slack = runtime_overhead_bytes(s, fullest)["fragmentation"]
    return MemoryCheck(fullest / GIB, max(moments, key=moments.__getitem__), (fullest + slack) / GIB,
                       fit_verdict(fullest, s.parallel, "cuda", memory))


@dataclass(frozen=True)
class RowCheck:
    """One published run against its prediction."""
    row: PublishedRow
    predicted_step_s: float
    memory: MemoryCheck | None
    caveats: tuple[str, ...] = ()
    """What the predicted step assumes in place of what the row's spec asks for (StepTime.caveats)."""

    @property
    def step_error_pct(self) -> float:
        """(predicted - published) / published: negative = the model is too fast."""
        return (self.predicted_step_s - self.row.step_s) / self.row.step_s * 100

    @property
    def memory_error_pct(self) -> float | None:
        """The predicted reserved against the published peak reserved, where the source gives one."""
        if self.row.memory_gib is None or self.memory is None:
            return None
        return (self.memory.reserved_gib - self.row.memory_gib) / self.row.memory_gib * 100

    @property
    def fullest_under_published(self) -> bool | None:
        if self.row.memory_gib is None or self.memory is None:
            return None
        return self.memory.fullest_gib <= self.row.memory_gib

    @property
    def moe(self) -> bool:
        return self.row.group.endswith(MOE_SUFFIX)


def check_row(row: PublishedRow) -> RowCheck:
    step = predicted_step(row.spec, row.hardware)
    return RowCheck(row, float(step.summary["step_s"]), memory_check(row.spec, row.hardware), tuple(step.caveats))


def check_rows(stack: str | None = None) -> list[RowCheck]:
    """Every published row (of one stack, when given) against its prediction."""
    return [check_row(r) for r in published_rows() if stack is None or r.stack == stack]


@dataclass(frozen=True)
class ErrorStats:
    """Mean |error|, mean signed error and worst |error| (percent) of some rows."""
    rows: int
    mean_abs_pct: float
    mean_pct: float
    worst_pct: float

    @classmethod
    def of(cls, errors: list[float]) -> ErrorStats | None:
        if not errors:
            return None
        return cls(len(errors), statistics.mean(abs(e) for e in errors), statistics.mean(errors),
                   max(abs(e) for e in errors))


@dataclass(frozen=True)
class StackSummary:
    """One stack on one GPU profile, or on every H100 profile together (hardware "all H100")."""
    stack: str
    hardware: str
    moe: bool
    h100: bool
    """Every row ran on H100s (published group H100): the step-time target applies (dense rows)."""
    step: ErrorStats
    reserved: ErrorStats | None
    """The predicted reserved against the published peak, over the rows that give one."""
    fullest_under_published: int
    fits: int
    tight: int
    fit_rows: int
    """Rows with a fit verdict (a GPU profile with a memory size)."""

    @property
    def step_target_met(self) -> bool | None:
        """Issue 34's step-time target, for the H100 summaries of dense rows; None elsewhere (no target)."""
        if self.moe or not self.h100:
            return None
        return self.step.mean_abs_pct <= STEP_MEAN_TARGET_PCT and self.step.worst_pct <= STEP_WORST_TARGET_PCT


def _summary(stack: str, hardware: str, checks: list[RowCheck]) -> StackSummary:
    step = ErrorStats.of([c.step_error_pct for c in checks])
    assert step is not None
    with_peak = [c for c in checks if c.memory_error_pct is not None]
    verdicts = [c.memory.verdict for c in checks if c.memory is not None]
    h100 = all(c.row.group.startswith(TARGET_GROUP) for c in checks)
    return StackSummary(stack, hardware, checks[0].moe, h100, step,
                        ErrorStats.of([c.memory_error_pct for c in with_peak if c.memory_error_pct is not None]),
                        sum(bool(c.fullest_under_published) for c in with_peak), verdicts.count(FITS),
                        verdicts.count("tight"), len(verdicts))


def summaries(checks: Iterable[RowCheck]) -> list[StackSummary]:
    """Per stack, dense rows before MoE rows: one summary per GPU profile, then one over every H100 row."""
    checks = list(checks)
    out = []
    for moe in (False, True):
        part = [c for c in checks if c.moe == moe]
        for stack in dict.fromkeys(c.row.stack for c in part):
            mine = [c for c in part if c.row.stack == stack]
            for hw in dict.fromkeys(c.row.hardware for c in mine):
                out.append(_summary(stack, hw, [c for c in mine if c.row.hardware == hw]))
            h100 = [c for c in mine if c.row.group.startswith(TARGET_GROUP)]
            if h100 and len({c.row.hardware for c in h100}) > 1:
                out.append(_summary(stack, "all H100", h100))
    return out
