"""The `ds_config` ShardLab hands to `deepspeed.initialize`, in seed 004's shape (pure Python).

Written to the run folder (ds_config.json) and kept with the run's payload, so the stored run says exactly
which DeepSpeed configuration produced its numbers.
"""

from __future__ import annotations

from typing import Any

from backend.spec import ExperimentSpec
from backend.spec.framework_support import DEEPSPEED_STAGE

BUCKET_ELEMENTS = 5_000_000
"""reduce/allgather/prefetch bucket size in elements. DeepSpeed's default 5e8 allocates a ~2 GB bucket on
the first backward (measured, MACHINE_FACTS "Second frameworks"): 5e6 keeps small models' peaks honest."""
PERSISTENCE_THRESHOLD = 100_000
"""stage3_param_persistence_threshold (DeepSpeed's default 1e5): stage 3 keeps smaller parameters whole."""


def ds_config(spec: ExperimentSpec) -> dict[str, Any]:
    t, p = spec.train, spec.parallel
    stage = DEEPSPEED_STAGE[str(p.strategy)]
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": BUCKET_ELEMENTS,
        "allgather_bucket_size": BUCKET_ELEMENTS,
        "contiguous_gradients": True,
        "overlap_comm": False,
    }
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=BUCKET_ELEMENTS,
                    stage3_param_persistence_threshold=PERSISTENCE_THRESHOLD,
                    stage3_max_live_parameters=BUCKET_ELEMENTS, stage3_max_reuse_distance=BUCKET_ELEMENTS)
    if p.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if p.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    cfg: dict[str, Any] = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.microbatches,
        "zero_optimization": zero,
        # A client torch optimizer (same AdamW/SGD as the torch runs and the reference) instead of DeepSpeed's
        # CPU Adam, whose first use JIT-compiles a C++ extension (~90 s here).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if str(t.precision) == "bf16-mixed":
        cfg["bf16"] = {"enabled": True}
    elif str(t.precision) == "fp16-mixed":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}  # seed 004: dynamic loss scaling
    return cfg
