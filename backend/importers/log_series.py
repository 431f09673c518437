"""Logged steps per rank, the mixed-run / interleaved-rank rules, the warm-up rule and the measured summary.

A log record (one torchtitan metrics line, one Megatron iteration line, one DeepSpeed timer line) reports the mean
seconds per step over the steps since the previous record. Each rank's records are kept as packed arrays (a few
numbers per record), so a 100 MB log holds a few MB here.

Rules:
- the same step again on a rank that logs without a rank prefix, within one log interval of the last step, is
  another rank's line (several ranks writing one file): it is skipped and counted;
- a step lower than that (or any step going back on a prefixed rank), or a second start-of-run line for a rank, means
  the file holds more than one run: an error naming the lines, never a silent mix;
- WARMUP_RULE below.
"""

from __future__ import annotations

import math
import statistics
from array import array
from dataclasses import dataclass, field
from typing import Any

from backend.importers.import_result import LogImportError
from backend.importers.log_stream import LineStats, rank_outside

WARMUP_FRACTION = 0.05
WARMUP_RULE = ("warm-up excluded: every logged step up to max(the first logged step, 5% of the last logged step) "
               "(start-up, compilation and allocator / NCCL warm-up land there); --warmup-steps N sets the cut")
STORED_STEPS = 4096
"""Per-step times kept in the stored result per rank (the median is over every used record)."""
MAX_RECORDS = 1 << 17
"""Records kept per rank (~64 B each: 8 MiB); beyond it every other one is dropped and then only every 2nd, 4th, ...
record kept, so a log of any length reads in bounded memory (the median is then over that uniform subsample)."""
MAX_TOTAL_RECORDS = 1 << 21
"""Records kept over all ranks (~128 MiB): a world of W ranks keeps MAX_TOTAL_RECORDS // W per rank (at least
MIN_RECORDS_PER_RANK, at most MAX_RECORDS), so memory is bounded by the world size, never by the log's length."""
MIN_RECORDS_PER_RANK = 1024


@dataclass
class Series:
    steps: array = field(default_factory=lambda: array("q"))
    step_s: array = field(default_factory=lambda: array("d"))
    loss: array = field(default_factory=lambda: array("d"))
    has_loss: array = field(default_factory=lambda: array("b"))
    """1 where the record printed a loss (NaN and inf included: a diverged run), 0 where it printed none."""
    lines: array = field(default_factory=lambda: array("q"))
    reported: dict[str, array] = field(default_factory=dict)
    """Framework-reported numbers per record (tps, tflops, mfu %), NaN where a record lacks one."""
    max_gap: int = 1
    last_step: int = -1
    count: int = 0
    """Records seen (kept or not)."""
    stride: int = 1
    """Every stride-th record is kept (1 until the cap was reached)."""

    def thin(self) -> None:
        """Keep every other record (the newest kept) and from now on every 2 x stride-th."""
        for name in ("steps", "step_s", "loss", "has_loss", "lines"):
            setattr(self, name, getattr(self, name)[::-2][::-1])
        self.reported = {k: v[::-2][::-1] for k, v in self.reported.items()}
        self.stride *= 2


@dataclass
class Collector:
    framework: str
    world: int | None = None
    """GPUs of the config: a rank outside 0..world-1 (a rank prefix, Megatron's "[Rank N]") refuses the log."""
    stats: LineStats = field(default_factory=LineStats)
    series: dict[int | None, Series] = field(default_factory=dict)
    starts: dict[int | None, int] = field(default_factory=dict)
    """The first start-of-run line of each rank."""
    duplicates: int = 0
    memory: dict[int | None, dict[str, int]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    unparsed: int = 0
    """Lines that looked like a record but did not parse (a garbled or interleaved line): skipped and counted."""
    first_unparsed_line: int = 0

    def __post_init__(self) -> None:
        self.stats.world = self.world

    @property
    def records_cap(self) -> int:
        """Records kept per rank before thinning."""
        share = MAX_TOTAL_RECORDS // self.world if self.world else MAX_RECORDS
        return min(MAX_RECORDS, max(MIN_RECORDS_PER_RANK, share))

    def garbled(self, line: int) -> None:
        """A line that looked like a record and was not one: skipped, counted, the first one remembered."""
        self.unparsed += 1
        if not self.first_unparsed_line:
            self.first_unparsed_line = line

    def check_rank(self, rank: int, line: int, where: str) -> None:
        """LogImportError for a rank outside the config's world."""
        if self.world is not None and not 0 <= rank < self.world:
            raise LogImportError([rank_outside(rank, self.world, line, where)])

    def start(self, rank: int | None, line: int) -> None:
        first = self.starts.setdefault(rank, line)
        if first != line and self.series.get(rank) and len(self.series[rank].steps):
            raise LogImportError([f"the log holds more than one run: {_who(rank)} starts again at line {line} (first "
                                  f"start at line {first}); split the file and import each run"])

    def add(self, rank: int | None, step: int, step_s: float, line: int, loss: float | None = None,
            reported: dict[str, float] | None = None) -> None:
        """One step record; `loss` None when the line printed none (NaN / inf are a diverged run's, kept)."""
        s = self.series.get(rank)
        if s is None:
            s = self.series[rank] = Series()
        last = s.last_step
        if s.count:
            if step <= last:
                if rank is None and last - step <= s.max_gap:  # another rank's line of (nearly) the same step
                    self.duplicates += 1
                    return
                raise LogImportError([f"the log holds more than one run: {_who(rank)} logs step {step} at line {line} "
                                      f"after step {last} (line {s.lines[-1]}); split the file and import each run"])
            if step - last > s.max_gap:
                s.max_gap = step - last
        s.last_step = step
        s.count += 1
        if s.count % s.stride:
            return
        n = len(s.steps)
        s.steps.append(step)
        s.step_s.append(step_s)
        s.loss.append(math.nan if loss is None else loss)
        s.has_loss.append(loss is not None)
        s.lines.append(line)
        if reported or s.reported:
            _append_reported(s, n, reported or {})
        if n + 1 > self.records_cap:
            s.thin()

    def peak(self, rank: int | None, key: str, value_bytes: float) -> None:
        slot = self.memory.setdefault(rank, {})
        slot[key] = max(slot.get(key, 0), int(value_bytes))


def _append_reported(s: Series, n: int, reported: dict[str, float]) -> None:
    for key, value in reported.items():
        if key not in s.reported:  # first seen now: earlier records lack it
            s.reported[key] = array("d", [math.nan] * n)
        s.reported[key].append(value)
    for column in s.reported.values():
        if len(column) == n:
            column.append(math.nan)


def _who(rank: int | None) -> str:
    return "the log" if rank is None else f"rank {rank}"


@dataclass
class Measured:
    """What a log measured, after the warm-up rule."""

    step_s_median: float
    per_rank_step_s: dict[int, list[float]]
    losses: list[float]
    warmup_cut_step: int
    records_total: int
    records_used: int
    first_step: int
    last_step: int
    memory: dict[int, dict[str, int]]
    reported: dict[str, float]
    notes: list[str]
    partial_reasons: list[str]


def summarise(c: Collector, *, warmup_steps: int | None = None, what: str = "step records") -> Measured:
    """The warm-up rule applied to every rank; LogImportError when nothing measured remains."""
    ranks = {r: s for r, s in c.series.items() if len(s.steps)}
    if not ranks:
        raise LogImportError([f"no {what} in the log" + (f" ({c.unparsed} garbled ones)" if c.unparsed else "")
                              + ": is it the training log of this framework, with its per-step lines?"])
    first = min(s.steps[0] for s in ranks.values())
    last = max(s.steps[-1] for s in ranks.values())
    cut = warmup_steps if warmup_steps is not None else max(first, math.ceil(WARMUP_FRACTION * last))
    per_rank: dict[int, list[float]] = {}
    used_total, total, losses = 0, 0, []
    medians, reported = [], {}
    for rank, s in sorted(ranks.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        used = [i for i in range(len(s.steps)) if s.steps[i] > cut]
        total += s.count
        if not used:
            continue
        used_total += len(used)
        times = [s.step_s[i] for i in used]
        medians.append(statistics.median(times))
        per_rank[0 if rank is None else rank] = times[-STORED_STEPS:]
        if not losses:
            losses = [s.loss[i] for i in used if s.has_loss[i]][-STORED_STEPS:]
        for key, column in s.reported.items():
            values = [column[i] for i in used if not math.isnan(column[i])]
            if values and key not in reported:
                reported[key] = statistics.median(values)
    if not medians:
        raise LogImportError([f"every logged step is warm-up (steps {first}..{last}, cut at step {cut}): the run is "
                              "too short to measure; give --warmup-steps to lower the cut"])
    notes = [WARMUP_RULE + f": cut at step {cut}, {used_total} of {total} records used"]
    if thinned := [r for r, s in ranks.items() if s.stride > 1]:
        notes.append(f"a long log: {_who(thinned[0])} logged {ranks[thinned[0]].count:,} steps; every "
                     f"{ranks[thinned[0]].stride}th is used (bounded memory), a uniform subsample")
    if c.duplicates:
        notes.append(f"{c.duplicates} repeated step lines from ranks logging without a rank prefix were skipped "
                     "(several ranks wrote one file; the first line of each step is used)")
    partial = []
    if c.stats.truncated_last_line:
        partial.append("the log ends inside a line (cut or still being written): its last line was not read")
    if c.stats.overlong:
        partial.append(f"{c.stats.overlong} lines over {64} KiB were skipped")
    if c.unparsed:
        partial.append(f"{c.unparsed:,} line{'s' if c.unparsed > 1 else ''} not understood (garbled or interleaved), "
                       f"first at line {c.first_unparsed_line}")
    memory = {0 if r is None else r: v for r, v in c.memory.items()}
    return Measured(step_s_median=max(medians), per_rank_step_s=per_rank, losses=losses, warmup_cut_step=cut,
                    records_total=total, records_used=used_total, first_step=first, last_step=last, memory=memory,
                    reported=reported, notes=notes, partial_reasons=partial)
