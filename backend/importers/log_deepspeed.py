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

from backend.importers.imported import ImportedConfig
from backend.importers.log_series import Collector
from backend.importers.log_stream import read_lines

TIMERS = re.compile(r"time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) \|.*\| step: ([\d.]+)")
THROUGHPUT = re.compile(r"epoch=(\d+)/micro_step=(\d+)/global_step=(\d+), RunningAvgSamplesPerSec=(\S+), "
                        r"CurrSamplesPerSec=(\S+), MemAllocated=([\d.]+)GB, MaxMemAllocated=([\d.]+)GB")
SEE_MEMORY = re.compile(r"^MA ([\d.]+) GB\s+Max_MA ([\d.]+) GB\s+CA ([\d.]+) GB\s+Max_CA ([\d.]+) GB")
PROFILER = re.compile(r"^(iter latency|world size|samples/second|FLOPS per GPU = [^:]+):\s+(\S+)\s*(\S*)")
START = "DeepSpeed info: version="
UNIT = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3, "u": 1e-6}
GiB = 1 << 30


def parse(path: str | Path, imported: ImportedConfig) -> Collector:
    batch = imported.spec["train"]["global_batch"]
    c = Collector("deepspeed")
    timer_steps: dict[int | None, int] = {}
    throughput: list[tuple[int | None, int, float, int]] = []
    for line in read_lines(path, c.stats):
        text = line.text
        if "time (ms) | fwd:" in text:
            m = TIMERS.search(text)
            if m is None:
                c.unparsed += 1
                continue
            step = timer_steps[line.rank] = timer_steps.get(line.rank, 0) + 1
            c.add(line.rank, step, (float(m.group(1)) + float(m.group(2)) + float(m.group(3))) / 1000.0, line.number)
        elif "CurrSamplesPerSec=" in text:
            m = THROUGHPUT.search(text)
            if m is None or not _positive(m.group(5)):
                c.unparsed += 1
                continue
            throughput.append((line.rank, int(m.group(3)), batch / float(m.group(5)), line.number))
            c.peak(line.rank, "allocated_bytes", float(m.group(7)) * GiB)
        elif m := SEE_MEMORY.search(text):
            c.peak(line.rank, "allocated_bytes", float(m.group(2)) * GiB)
            c.peak(line.rank, "reserved_bytes", float(m.group(4)) * GiB)
            c.facts["reserved_rounding"] = "Max_CA is rounded to a whole GiB by DeepSpeed"
        elif m := PROFILER.search(text.strip()):
            c.facts.setdefault("flops_profiler", {})[m.group(1)] = f"{m.group(2)} {m.group(3)}".strip()
        elif text.startswith("Profile Summary at step "):
            c.facts["profile_step"] = int(text.rsplit(" ", 1)[1].rstrip(":") or 0)
        elif START in text:
            c.start(line.rank, line.number)
    if not c.series and throughput:  # no wall_clock_breakdown: the throughput timer's steps
        for rank, step, seconds, number in throughput:
            c.add(rank, step, seconds, number)
        c.facts["step_source"] = "throughput timer: train_batch_size / CurrSamplesPerSec (that step's seconds)"
    elif c.series:
        c.facts["step_source"] = "engine timers: fwd + bwd + step per optimizer step (wall_clock_breakdown)"
    _profiler_step(c)
    c.facts["memory_source"] = ("DeepSpeed: MaxMemAllocated of the throughput timer (torch.cuda.max_memory_allocated, "
                                "GiB with 2 decimals) and see_memory_usage's Max_MA / Max_CA where memory_breakdown "
                                "printed them; rank 0 only")
    return c


def _profiler_step(c: Collector) -> None:
    """With no per-step lines at all, the flops profiler's iter latency at its profile step is the one record."""
    prof = c.facts.get("flops_profiler") or {}
    if c.series or "iter latency" not in prof:
        return
    value, _, unit = prof["iter latency"].partition(" ")
    seconds = float(value) * UNIT.get(unit[:-1] if unit.endswith("s") else unit, 1.0)
    step = c.facts.get("profile_step") or 1
    c.add(None, step, seconds, 0)
    c.facts["single_profiled_step"] = step
    c.facts["step_source"] = (f"flops profiler: iter latency (fwd + bwd + step) of step {step}, the only step this log "
                              "times (no warm-up cut: a warm profile_step is the user's choice)")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False
