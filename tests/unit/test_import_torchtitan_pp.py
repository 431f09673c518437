"""torchtitan gradient accumulation x pipelining: each accumulation step runs its own pipeline schedule (train.py
Trainer.__init__ gradient_accumulation_steps = global batch / (local batch x dp), train_step one pp_schedule.step
per step; build_pipeline_schedule n_microbatches = local batch / pipeline_parallel_microbatch_size). The spec holds
all the step's microbatches in one schedule and has no field for schedules per step, so the import keeps the spec
and reports the difference in `unmapped`, with the arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.importers import import_config_text

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
TOML = """\
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 8
global_batch_size = {glob}
seq_len = 8192
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 1
[activation_checkpoint]
mode = "full"
"""


def _toml(glob: int):
    return import_config_text(TOML.format(glob=glob), name="llama3_8b.toml", gpus=128)


def test_four_schedules_of_eight_are_reported_with_the_arithmetic():
    imported = _toml(256)
    t, p = imported.spec["train"], imported.spec["parallel"]
    assert (p["dp"], p["pp"], p["virtual_stages"], t["micro_batch"], t["microbatches"]) == (8, 2, 2, 1, 32)
    reason = imported.unmapped["training.global_batch_size"]["reason"]
    assert "torchtitan runs 4 pipeline schedules of 8 microbatches per step" in reason
    assert "global batch 256 / (local batch 8 x dp 8) = 4" in reason
    assert "local batch 8 / pipeline_parallel_microbatch_size 1 = 8" in reason
    assert f"{1 / 65:.4f} of the step" in reason and f"idles {1 / 17:.4f}" in reason  # (p-1)/(v m + p-1), m 32 / 8


@pytest.mark.parametrize("glob", [64, -1])
def test_one_schedule_per_step_reports_nothing(glob):
    imported = _toml(glob)
    assert imported.spec["train"]["microbatches"] == 8
    assert "training.global_batch_size" not in imported.unmapped


def test_the_trainer_config_dump_reports_it_too():
    cfg = json.loads((FIX / "torchtitan_trainer_config.json").read_text())
    cfg["training"] |= {"local_batch_size": 4, "global_batch_size": 32}
    cfg["parallelism"] |= {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 2}
    imported = import_config_text(json.dumps(cfg), name="config.json", gpus=16)  # tp 2 x pp 2: dp 4, 2 steps
    reason = imported.unmapped["training.global_batch_size"]["reason"]
    assert "torchtitan runs 2 pipeline schedules of 2 microbatches per step" in reason
