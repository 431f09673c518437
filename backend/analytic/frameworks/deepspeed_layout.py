"""Per-rank model-state bytes of DeepSpeed 0.19.8's ZeRO engine for ShardLab's GPT, pure Python.

The ZeRO paper's accounting (Rajbhandari et al. 2020, §3.1 and Fig. 1: 2Ψ + 2Ψ + KΨ with K = 12 for mixed
precision Adam; §5.1-5.3 for P_os, P_os+g, P_os+g+p) applied to the buffers DeepSpeed really allocates
(read from deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, 0.19.8):
- stages 1-2 flatten every parameter into one buffer padded to a multiple of 2N elements
  (nccl_start_alignment_factor = 2 times the dp world N) and keep an fp32 master copy of this rank's 1/N of
  it (`single_partition_of_fp32_groups`), even in fp32 training;
- stage 3 partitions each parameter on its own (ceil(numel / N) elements, `ds_tensor`), keeps an fp32 master
  of the flat partition (`fp32_partitioned_groups_flat`), and keeps parameters of at most
  `stage3_param_persistence_threshold` elements whole on every rank after their first use (`ds_persist`);
- stage 0 is plain data parallelism: the client optimizer steps on the module's own parameters, no master
  copy in fp32; bf16/fp16 without ZeRO wrap it in FP16_UnfusedOptimizer with a whole fp32 copy per parameter
  (engine.py `_do_optimizer_sanity_check`: DDP_BFLOAT16, gradients accumulated in the 16-bit dtype);
- optimizer state: Adam m and v (2 x 4 B per master element, Kingma & Ba 2015 Alg. 1) or SGD momentum
  (4 B), plus torch's 4 B `step` tensor per optimized tensor (AdamW only);
- gradient buckets: ZeRO-3 preallocates one reduce bucket of `reduce_bucket_size` elements in the parameter
  dtype that gradients are copied into; stages 1-2 build theirs during backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.params import param_list
from backend.spec.choices import Optimizer

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

ALIGN = 2  # DeepSpeed stage_1_and_2.py: nccl_start_alignment_factor = 2
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


@dataclass(frozen=True)
class DeepSpeedRank:
    params_bytes: int
    """The module's parameter storage: DeepSpeed's flat buffer (stages 0-2), or this rank's partitions plus
    the persistent whole parameters (stage 3)."""
    master_bytes: int
    """fp32 master partition the optimizer steps on (0 where it steps on the module's parameters)."""
    optimizer_state_bytes: int
    """Adam m + v (or SGD momentum) over the master elements, plus AdamW's step counters."""
    grad_bucket_bytes: int
    """Preallocated gradient bucket (ZeRO-3's reduce bucket); stage 0-2 buffers appear during backward."""
    persistent_params: int
    """Stage 3: elements of parameters kept whole on every rank (numel <= persistence threshold)."""
    backward_bucket_bytes: int = 0
    """Stages 1-2: the reduce (IPG) bucket contiguous_gradients allocates at the first backward, reduce_bucket_size
    elements in the parameters' dtype: in the step's peak, in no category (measured on 2 gloo ranks: fp32 ZeRO-1
    and ZeRO-2 peaks 22.6 / 22.1 MiB with a 19.07 MiB bucket, bf16 ZeRO-2 11.5 MiB with 9.54 MiB)."""

    @property
    def model_state_bytes(self) -> int:
        """Params + master + optimizer state: what stays resident between steps (buckets excluded)."""
        return self.params_bytes + self.master_bytes + self.optimizer_state_bytes


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def deepspeed_rank(spec: ExperimentSpec, *, bucket_elements: int, persistence_threshold: int) -> DeepSpeedRank:
    """One rank's model states (all ranks alike: DeepSpeed pads so every partition has the same size)."""
    stage = STAGE[str(spec.parallel.strategy)]
    n = spec.parallel.world_size
    precision = str(spec.train.precision)
    b = _dtype_bytes(precision)
    numels = [q.numel for q in param_list(spec.model)]
    total = sum(numels)
    adam = spec.train.optimizer == Optimizer.ADAMW
    states = 2 if adam else 1
    if stage == 3:
        part = sum(-(-k // n) for k in numels)  # ceil(numel / N) per parameter
        persistent = sum(k for k in numels if k <= persistence_threshold)
        return DeepSpeedRank(params_bytes=b * (part + persistent), master_bytes=4 * part,
                             optimizer_state_bytes=4 * states * part + (4 if adam else 0),
                             grad_bucket_bytes=b * bucket_elements, persistent_params=persistent)
    if stage == 0:
        steps = 4 * len(numels) if adam else 0
        if precision == "fp32":
            return DeepSpeedRank(params_bytes=4 * total, master_bytes=0,
                                 optimizer_state_bytes=4 * states * total + steps, grad_bucket_bytes=0,
                                 persistent_params=0)
        # 16-bit without ZeRO: DeepSpeed's DDP_BFLOAT16 / FP16 path (FP16_UnfusedOptimizer) keeps a whole fp32 copy
        # of every parameter, stepped per parameter (one AdamW step counter each)
        return DeepSpeedRank(params_bytes=b * total, master_bytes=4 * total,
                             optimizer_state_bytes=4 * states * total + steps, grad_bucket_bytes=0, persistent_params=0)
    padded = -(-total // (ALIGN * n)) * ALIGN * n  # one flat group, padded to a multiple of 2N
    part = padded // n
    return DeepSpeedRank(params_bytes=b * padded, master_bytes=4 * part,
                         optimizer_state_bytes=4 * states * part + (4 if adam else 0), grad_bucket_bytes=0,
                         persistent_params=0, backward_bucket_bytes=b * bucket_elements)
