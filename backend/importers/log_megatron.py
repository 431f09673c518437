"""Megatron-LM's training log: iteration lines and the per-rank memory report.

Formats from megatron/training/training.py `training_log` and utils `report_memory` (2023-2026):
  " [2026-03-01 10:00:00.123456] iteration       10/     500 | consumed samples:         2560 | elapsed time per
   iteration (ms): 9876.5 | throughput per GPU (TFLOP/s/GPU): 412.3 | learning rate: 1.500000E-04 | global batch
   size:   256 | lm loss: 9.876543E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
   number of nan iterations:   0 |"   (older logs have no timestamp and no throughput field)
  "[Rank 3] (after 10 iterations) memory (MB) | allocated: 12345.67 | max allocated: 23456.78 | reserved: 34567.89 |
   max reserved: 34567.89"   (printed by data-parallel rank 0 of every model-parallel group)
The iteration line is printed by the last rank; its elapsed time is the mean per iteration since the previous line
(timers 'interval-time'). MB here is MiB (bytes / 1024 / 1024).
"""

from __future__ import annotations

import re
from pathlib import Path

from backend.importers import log_values as v
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector
from backend.importers.log_stream import read_lines

ITERATION = re.compile(r"iteration\s+(\S+?)/\s*(\S+?)\s*\|(.*)$")
MEMORY = re.compile(r"\[Rank (\d+)\] .*?memory \(MB\) \| allocated: (\S+) \| max allocated: (\S+) \| "
                    r"reserved: (\S+) \| max reserved: (\S+)")
START = re.compile(r"-{4,} arguments -{4,}")
STEP_MS = "elapsed time per iteration (ms)"
TFLOPS = "throughput per GPU (TFLOP/s/GPU)"
MiB = 1 << 20


def parse(path: str | Path, imported: ImportedConfig) -> Collector:
    c = Collector("megatron", world=imported.gpus or imported.spec["parallel"]["world_size"])
    for line in read_lines(path, c.stats):
        text = line.text
        try:
            if "iteration" in text and "elapsed time per iteration" in text:
                _iteration(c, line.rank, text, line.number)
            elif "memory (MB)" in text:
                _memory(c, text, line.number)
            elif START.search(text):
                c.start(line.rank, line.number)
            elif "[after training is done]" in text:
                c.facts["completed"] = True
        except v.Garbled:
            c.garbled(line.number)
    c.facts["memory_source"] = ("Megatron's report_memory: torch.cuda.max_memory_allocated / max_memory_reserved per "
                                "reporting rank (MB = MiB, 2 decimals)")
    return c


def _iteration(c: Collector, rank: int | None, text: str, number: int) -> None:
    m = ITERATION.search(text)
    fields = _fields(m.group(3)) if m else {}
    if STEP_MS not in fields:
        raise v.Garbled(text)
    step = v.integer(m.group(1), "the iteration", number)
    total = v.integer(m.group(2), "the iteration count", number)
    ms = v.positive(fields[STEP_MS], STEP_MS, number)
    step_s = v.step_seconds(ms / 1000.0, STEP_MS, fields[STEP_MS], number)
    extra = {}
    if TFLOPS in fields:
        extra["tflops_per_device"] = v.non_negative(fields[TFLOPS], TFLOPS, number)
    loss = v.loss(fields["lm loss"]) if "lm loss" in fields else None
    c.add(rank, step, step_s, number, loss, extra)
    c.facts.setdefault("train_iters", total)


def _memory(c: Collector, text: str, number: int) -> None:
    m = MEMORY.search(text)
    if m is None:
        raise v.Garbled(text)
    rank = v.integer(m.group(1), "the memory report's rank", number)
    c.check_rank(rank, number, f"the memory report '[Rank {rank}]'")
    allocated = v.memory_bytes(m.group(3), MiB, "max allocated (MB)", number)
    reserved = v.memory_bytes(m.group(5), MiB, "max reserved (MB)", number)
    c.peak(rank, "allocated_bytes", allocated)
    c.peak(rank, "reserved_bytes", reserved)


def _fields(tail: str) -> dict[str, str]:
    out = {}
    for part in tail.split("|"):
        key, sep, value = part.rpartition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out
