"""torchtitan's training log: its metrics lines, and the device line.

Formats from torchtitan's source (components/metrics.py `MetricsProcessor.log`, train.py), ANSI colours removed:
  v0.1.0 (June 2025): "step: 10  loss:  9.8765  memory: 42.18GiB(53.26%)  tps: 1,198  tflops: 69.38  mfu: 7.02%"
  mid-2025 and later: "step: 10  loss:  9.87654  grad_norm:  1.2345  memory: 42.18GiB(53.26%)  tps: 1,198
                       tflops: 69.38  mfu: 7.02%"   (mfu "N/A" under fp8 / MX quantization)
  autumn 2024:        "step: 10  loss:  9.8765  memory: 42.18GiB(53.26%)  wps: 1,198  mfu: 7.02%"
  "CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory" (older "GPU capacity: ..."), "Training starts at
  step 1." (a run's start), "Model llama3 8B size: 8,030,261,248 total parameters".
tps is tokens per second per device over the steps since the previous metrics line (ntokens / (time x the
non-data-parallel size)), so seconds per step = global tokens per step / (tps x GPUs). memory is the peak
RESERVED memory (reserved_bytes.all.peak) since the previous line, in GiB with 2 decimals; torchtitan prints no
allocated peak.
"""

from __future__ import annotations

import re
from pathlib import Path

from backend.importers import log_values as v
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector
from backend.importers.log_stream import read_lines

METRICS = re.compile(r"step:\s*(\S+)\s+loss:\s*(\S+)\s+(?:grad_norm:\s*\S+\s+)?"
                     r"memory:\s*(\S*?)GiB\(\s*([^)]*?)%\)\s+(tps|wps):\s*(\S*)\s+"
                     r"(?:tflops:\s*(\S*)\s+)?mfu:\s*(\S*)")
DEVICE = re.compile(r"(?:CUDA|GPU|ROCM|XPU) capacity: (.+?) with ([\d.]+)GiB memory")
PARAMS = re.compile(r"Model (\S+) (\S+) size: ([\d,]+) total parameters")
START = "Training starts at step"
GiB = 1 << 30


def parse(path: str | Path, imported: ImportedConfig) -> Collector:
    tokens = imported.spec["train"]["global_batch"] * imported.spec["model"]["seq_len"]
    gpus = imported.gpus or imported.spec["parallel"]["world_size"]
    c = Collector("torchtitan", world=gpus)
    for line in read_lines(path, c.stats):
        text = line.text
        at = text.find("step:")
        try:
            if at >= 0 and "loss:" in text and "validate step:" not in text:
                _metrics(c, line.rank, text, at, line.number, tokens, gpus)
            elif START in text:
                c.start(line.rank, line.number)
            elif m := DEVICE.search(text):
                c.facts.setdefault("device_name", m.group(1).strip())
                c.facts.setdefault("device_memory_gib",
                                   v.non_negative(m.group(2), "the device memory (GiB)", line.number))
            elif m := PARAMS.search(text):
                c.facts.setdefault("framework_param_count", int(m.group(3).replace(",", "") or 0))
            elif "Training completed" in text:
                c.facts["completed"] = True
        except v.Garbled:
            c.garbled(line.number)
    c.facts["memory_source"] = ("peak reserved: torchtitan's memory GiB (reserved_bytes.all.peak since the previous "
                                "metrics line, 2 decimals); torchtitan logs no allocated peak")
    return c


def _metrics(c: Collector, rank: int | None, text: str, at: int, number: int, tokens: int, gpus: int) -> None:
    m = METRICS.match(text, at)
    if m is None:
        raise v.Garbled(text)
    step = v.integer(m.group(1), "the step", number)
    loss = v.loss(m.group(2))
    reserved = v.memory_bytes(m.group(3), GiB, "memory (GiB)", number)
    tps = v.positive(m.group(6), m.group(5), number, commas=True)
    step_s = v.step_seconds(tokens / (tps * gpus), f"the step time from {m.group(5)} (global tokens / ({m.group(5)} x "
                            f"{gpus} GPUs))", m.group(6), number)
    extra = {"tps_per_device": tps}
    if m.group(7) is not None:
        extra["tflops_per_device"] = v.non_negative(m.group(7), "tflops", number, commas=True)
    if m.group(8) != "N/A":
        extra["mfu_pct"] = v.non_negative(m.group(8).removesuffix("%"), "mfu", number)
    c.add(rank, step, step_s, number, loss, extra)
    c.peak(rank, "reserved_bytes", reserved)
