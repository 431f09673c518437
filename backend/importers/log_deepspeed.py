"""DeepSpeed's training log: engine timers, the throughput timer, the flops profiler and see_memory_usage.

Formats from DeepSpeed 0.19.8's source:
- wall_clock_breakdown (utils/timer.py `SynchronizedWallClockTimer.log`, printed by print_dist on rank 0), one line per
  optimizer step with the global timers in ms, after a micro-step line with the *_microstep timers:
    "[Rank 0] time (ms) | fwd: 410.12 | bwd: 820.50 | bwd_inner: 700.10 | bwd_allreduce: 120.20 | step: 95.30"
  step seconds = (fwd + bwd + step) / 1000, as the flops profiler's "iter latency" sums them.
- the throughput timer (utils/timer.py `ThroughputTimer.stop`, every steps_per_print optimizer steps, logger format
  "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"):
    "epoch=0/micro_step=40/global_step=10, RunningAvgSamplesPerSec=55.8, CurrSamplesPerSec=56.1,
     MemAllocated=12.5GB, MaxMemAllocated=30.1GB"      (GB = bytes / 1024**3, 2 decimals)
  CurrSamplesPerSec is train_batch_size / that step's seconds; MaxMemAllocated is torch.cuda.max_memory_allocated.
- the flops profiler (profiling/flops_profiler/profiler.py `print_model_profile`) at profile_step: "world size:",
  "iter latency: 1.23 s", "FLOPS per GPU = 4 * fwd flops per GPU / iter latency: 123.45 TFLOPS", "samples/second:".
- see_memory_usage (memory_breakdown): "MA 12.5 GB  Max_MA 30.1 GB  CA 31.0 GB  Max_CA 31 GB" (Max_CA rounded to
  a whole GB by DeepSpeed).
"""

from __future__ import annotations

import re
from pathlib import Path

from backend.importers import log_values as v
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector
from backend.importers.log_stream import read_lines

TIMERS = re.compile(r"time \(ms\) \| fwd: (\S+) \| bwd: (\S+) \|.*\| step: (\S+)")
THROUGHPUT = re.compile(r"epoch=(\S+?)/micro_step=(\S+?)/global_step=(\S+?), RunningAvgSamplesPerSec=(\S+), "
                        r"CurrSamplesPerSec=(\S+), MemAllocated=(\S*?)GB, MaxMemAllocated=(\S*?)GB")
SEE_MEMORY = re.compile(r"^MA (\S+) GB\s+Max_MA (\S+) GB\s+CA (\S+) GB\s+Max_CA (\S+) GB")
PROFILER = re.compile(r"^(iter latency|world size|samples/second|FLOPS per GPU = [^:]+):\s+(\S+)\s*(\S*)")
PROFILE_STEP = "Profile Summary at step "
START = "DeepSpeed info: version="
UNIT = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3, "u": 1e-6}
GiB = 1 << 30


def parse(path: str | Path, imported: ImportedConfig) -> Collector:
    batch = imported.spec["train"]["global_batch"]
    c = Collector("deepspeed", world=imported.gpus or imported.spec["parallel"]["world_size"])
    fallback = Collector("deepspeed", world=c.world)  # the throughput timer's steps, used without engine timers
    timer_steps: dict[int | None, int] = {}
    profiled: list[tuple[float, int]] = []
    for line in read_lines(path, c.stats):
        text = line.text
        try:
            if "time (ms) | fwd:" in text:
                _timers(c, timer_steps, line.rank, text, line.number)
            elif "CurrSamplesPerSec=" in text:
                _throughput(c, fallback, batch, line.rank, text, line.number)
            elif m := SEE_MEMORY.search(text):
                c.peak(line.rank, "allocated_bytes", v.memory_bytes(m.group(2), GiB, "Max_MA (GB)", line.number))
                c.peak(line.rank, "reserved_bytes", v.memory_bytes(m.group(4), GiB, "Max_CA (GB)", line.number))
                c.facts["reserved_rounding"] = "Max_CA is rounded to a whole GiB by DeepSpeed"
            elif m := PROFILER.search(text.strip()):
                if m.group(1) == "iter latency":
                    profiled[:] = [(_latency_s(m.group(2), m.group(3), line.number), line.number)]
                c.facts.setdefault("flops_profiler", {})[m.group(1)] = f"{m.group(2)} {m.group(3)}".strip()
            elif text.startswith(PROFILE_STEP):
                step_text = text[len(PROFILE_STEP):].strip().removesuffix(":")
                c.facts["profile_step"] = v.integer(step_text, "the profile step", line.number)
            elif START in text:
                c.start(line.rank, line.number)
        except v.Garbled:
            c.garbled(line.number)
    if not c.series and fallback.series:  # no wall_clock_breakdown: the throughput timer's steps
        c.series, c.duplicates = fallback.series, c.duplicates + fallback.duplicates
        c.facts["step_source"] = "throughput timer: train_batch_size / CurrSamplesPerSec (that step's seconds)"
    elif c.series:
        c.facts["step_source"] = "engine timers: fwd + bwd + step per optimizer step (wall_clock_breakdown)"
    _profiler_step(c, profiled)
    c.facts["memory_source"] = ("DeepSpeed: MaxMemAllocated of the throughput timer (torch.cuda.max_memory_allocated, "
                                "GiB with 2 decimals) and see_memory_usage's Max_MA / Max_CA where memory_breakdown "
                                "printed them; rank 0 only")
    return c


def _timers(c: Collector, timer_steps: dict[int | None, int], rank: int | None, text: str, number: int) -> None:
    m = TIMERS.search(text)
    if m is None:
        raise v.Garbled(text)
    parts = [v.non_negative(m.group(i), name, number) for i, name in ((1, "fwd (ms)"), (2, "bwd (ms)"),
                                                                      (3, "step (ms)"))]
    seconds = v.step_seconds(sum(parts) / 1000.0, "fwd + bwd + step", f"{m.group(1)} + {m.group(2)} + {m.group(3)} ms",
                             number)
    step = timer_steps[rank] = timer_steps.get(rank, 0) + 1
    c.add(rank, step, seconds, number)


def _throughput(c: Collector, fallback: Collector, batch: int, rank: int | None, text: str, number: int) -> None:
    m = THROUGHPUT.search(text)
    if m is None:
        raise v.Garbled(text)
    step = v.integer(m.group(3), "global_step", number)
    samples_per_s = v.positive(m.group(5), "CurrSamplesPerSec", number)
    seconds = v.step_seconds(batch / samples_per_s, "train_batch_size / CurrSamplesPerSec", m.group(5), number)
    allocated = v.memory_bytes(m.group(7), GiB, "MaxMemAllocated (GB)", number)
    fallback.add(rank, step, seconds, number)
    c.peak(rank, "allocated_bytes", allocated)


def _latency_s(value: str, unit: str, number: int) -> float:
    """The flops profiler's "iter latency: 1.23 s" (or ms, us) in seconds; refused when impossible."""
    scale = UNIT.get(unit[:-1] if unit.endswith("s") else unit)
    if scale is None:
        raise v.Garbled(unit)
    seconds = v.positive(value, "iter latency", number) * scale
    return v.step_seconds(seconds, "iter latency", f"{value} {unit}", number)


def _profiler_step(c: Collector, profiled: list[tuple[float, int]]) -> None:
    """With no per-step lines at all, the flops profiler's iter latency at its profile step is the one record."""
    if c.series or not profiled:
        return
    seconds, number = profiled[-1]
    step = c.facts.get("profile_step") or 1
    c.add(None, step, seconds, number)
    c.facts["single_profiled_step"] = step
    c.facts["step_source"] = (f"flops profiler: iter latency (fwd + bwd + step) of step {step}, the only step this log "
                              "times (no warm-up cut: a warm profile_step is the user's choice)")
