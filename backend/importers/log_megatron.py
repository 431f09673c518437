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

from backend.importers.imported import ImportedConfig
from backend.importers.log_series import Collector
from backend.importers.log_stream import read_lines

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
MEMORY = re.compile(r"\[Rank (\d+)\] .*?memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+) \| "
                    r"reserved: ([\d.]+) \| max reserved: ([\d.]+)")
START = re.compile(r"-{4,} arguments -{4,}")
MiB = 1 << 20


def parse(path: str | Path, imported: ImportedConfig) -> Collector:
    c = Collector("megatron")
    for line in read_lines(path, c.stats):
        text = line.text
        if "iteration" in text and "elapsed time per iteration" in text:
            m = ITERATION.search(text)
            fields = _fields(m.group(3)) if m else {}
            try:
                step_ms = float(fields["elapsed time per iteration (ms)"])
            except (KeyError, ValueError):
                c.unparsed += 1
                continue
            extra = {}
            if "throughput per GPU (TFLOP/s/GPU)" in fields:
                extra["tflops_per_device"] = _num(fields["throughput per GPU (TFLOP/s/GPU)"])
            loss = _num(fields.get("lm loss", "nan"))
            c.add(line.rank, int(m.group(1)), step_ms / 1000.0, line.number, loss, extra)
            c.facts.setdefault("train_iters", int(m.group(2)))
        elif "memory (MB)" in text:
            m = MEMORY.search(text)
            if m is None:
                c.unparsed += 1
                continue
            rank = int(m.group(1))
            c.peak(rank, "allocated_bytes", float(m.group(3)) * MiB)
            c.peak(rank, "reserved_bytes", float(m.group(5)) * MiB)
        elif START.search(text):
            c.start(line.rank, line.number)
        elif "[after training is done]" in text:
            c.facts["completed"] = True
    c.facts["memory_source"] = ("Megatron's report_memory: torch.cuda.max_memory_allocated / max_memory_reserved per "
                                "reporting rank (MB = MiB, 2 decimals)")
    return c


def _fields(tail: str) -> dict[str, str]:
    out = {}
    for part in tail.split("|"):
        key, sep, value = part.rpartition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")
