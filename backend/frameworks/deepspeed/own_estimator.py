"""DeepSpeed's own model-state estimators, called as DeepSpeed ships them: the "DeepSpeed's estimate" column.

`estimate_zero2_model_states_mem_needs` (used for stages 1 and 2: DeepSpeed has no stage-1 estimator) and
`estimate_zero3_model_states_mem_needs`; stage 0 has none. They take parameter counts only, so ShardLab's
analytic counts feed them (no model is built).
"""

from __future__ import annotations

from typing import Any

from backend.analytic.params import param_list
from backend.spec import ExperimentSpec
from backend.spec.framework_support import DEEPSPEED_STAGE


def deepspeed_estimate(spec: ExperimentSpec) -> dict[str, Any] | None:
    """{"function", "device_bytes", "host_bytes", "args"} per rank, or None for stage 0."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    stage = DEEPSPEED_STAGE[str(spec.parallel.strategy)]
    if stage == 0:
        return None
    params = param_list(spec.model)
    total = sum(q.numel for q in params)
    n, offload = spec.parallel.world_size, str(spec.parallel.offload)
    if stage in (1, 2):
        args = {"total_params": total, "num_gpus_per_node": n, "num_nodes": 1, "cpu_offload": offload != "none"}
        cpu, gpu = estimate_zero2_model_states_mem_needs(**args)
        fn = "estimate_zero2_model_states_mem_needs"
    else:
        args = {"total_params": total, "largest_layer_params": _largest_module(params), "num_gpus_per_node": n,
                "num_nodes": 1, "cpu_offload": offload != "none", "cpu_offload_params": offload == "params",
                "zero_init": False}
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(**args)
        fn = "estimate_zero3_model_states_mem_needs"
    return {"function": fn, "device_bytes": int(gpu), "host_bytes": int(cpu), "args": args}


def _largest_module(params: list) -> int:
    """As DeepSpeed's model_to_params: the most parameters one module holds itself (recurse=False)."""
    per: dict[str, int] = {}
    for q in params:
        per[q.module] = per.get(q.module, 0) + q.numel
    return max(per.values())
