"""Model states (params, grads, optimizer) per rank as each stack keeps them (issue 34 part 2), one layout or arrays
of them; `Layout.stack` (analytic/stack_memory.py) gives the dtypes, so every byte count follows the resolved
settings. Sources at the commits pinned in backend/spec/stacks.py (research notes: /work/wt/research/stacks.md).

Megatron-Core (mechanism "megatron"), Megatron-LM d98e8a64:
- `_ParamAndGradBuffer.__init__` (megatron/core/distributed/param_and_grad_buffer.py 1156-1195): `grad_data` always,
  numel x grad dtype (`group_params_for_buffers` 924: fp32 unless --grad-reduce-in-bf16); `param_data` numel x param
  dtype only with the distributed optimizer (the params become views of it); without it the params are the module's.
- DistributedOptimizer (megatron/core/optimizer/distrib_optimizer.py `_build_model_and_main_param_groups` 400-455):
  an fp32 `shard_main_param` of this rank's 1/d shard of every 16-bit param, Adam's exp_avg / exp_avg_sq on it
  (8/d B), d = the size of `intra_dp_cp_group` (dp x cp: distributed_data_parallel.py 149, optimizer/__init__.py
  1204-1205; dp alone when optimizer_over_cp is off). Padding (`_compute_per_buffer_param_layout` 506-588,
  optimizer/param_layout.py `pad_param_start` 24-42): every param starts on a 64-element boundary, the buffer ends
  on a multiple of lcm(d, 128). With --overlap-grad-reduce the buffer is cut into buckets of max(4e7, 1e6 d) elements,
  each end padded the same way (< lcm(d, 128) elements per bucket: not counted).
- Without the distributed optimizer, `Float16OptimizerWithFloat16Params` (optimizer/optimizer.py 964-1012): an fp32
  main copy of every 16-bit param and Adam on it: 2 + 4 + 4 + 8 = 18 B per param in bf16.
- Step: with a 16-bit grad buffer `_copy_model_grads_to_main_grads` (distrib_optimizer.py 2756-2792) makes an fp32
  copy of the shard's grads (4/d B), a step temporary (`step_temp_bytes_of_stack`).
- fp8 without fp8 params: TE caches the quantized weight (rowwise + columnwise) across micro-batches
  (TransformerEngine d0067d0 module/layernorm_linear.py 1763-1823, base.py 915; Megatron passes is_first_microbatch,
  extensions/transformer_engine.py 1338-1345): ~2 B per block linear weight element, counted with the params
  (research notes Sec 2.5: the exact Hopper bytes are not pinned down).
- zero2 / zero3 under megatron (Megatron-FSDP) are priced as FSDP2 with the stack's dtypes.

torchtitan (mechanism "fsdp2"), pytorch 01d5c2cc `_fsdp_api.py` MixedPrecisionPolicy, 8fc2039d
`_fsdp_collectives.py` foreach_reduce: sharded params and grads in the original dtype (param_dtype: fp32), AdamW on
the shard, no master copy; the unsharded compute copy (MixedPrecisionPolicy.param_dtype, bf16; the tp mixes too, as
torchtitan's apply_fsdp sets the policy whatever the tp degree) and the unsharded grads accumulated at the peak
(memory/fsdp_state.py `unsharded_at_peak`) in that dtype. Without FSDP (ddp / zero1): replicated params, grads and
Adam, zero1 sharding only the optimizer state.

DeepSpeed (mechanism "deepspeed"), DeepSpeed edaa7221, N = the data-parallel group:
- stage 0: module params, grads in grad_accum_dtype (engine.py get_data_types: the model dtype), FP16_Optimizer's
  fp32 master of every param + Adam (master + 8 B);
- stages 1-2: the flat bit16 buffer padded to a multiple of 2N (`nccl_start_alignment_factor`, stage_1_and_2.py
  347-351), the fp32 master partition `single_partition_of_fp32_groups` (490-509) + Adam over it; stage 1 keeps full
  grads until the boundary (1650-1690), stage 2 its partition `grads_in_partition` (1742-1772) plus one
  `reduce_bucket_size` (5e8 elements) IPG bucket in bit16 (`setup_buckets` 2494-2513; two with overlap_comm);
- stage 3: each param partitioned (2/N), grads `grad_partitions_flat_buffer` (stage3.py 1031-1122), fp32 master
  `fp32_partitioned_groups_flat`, one IPG bucket (730-750). Persistent small params and prefetched ones are not
  counted.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic.device import CUDA
from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.layout import Layout, RankPosition, ZeroStage
from backend.analytic.memory.fsdp_state import UnshardedAtPeak, unsharded_at_peak
from backend.analytic.memory.model_state import ModelStateBytes
from backend.analytic.memory.parts import ALT_PART, RankParts, local_part, tied_copy
from backend.analytic.optimizer_state import step_temp_bytes
from backend.analytic.params import ModelKey, model_key
from backend.analytic.scalar_or_array import any_true, ceil_div, logical_and, per_distinct, per_value, where
from backend.analytic.stack_memory import StackMemory

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

MEGATRON_PARAM_ALIGN = 64
"""optimizer/param_layout.py pad_param_start: "Align parameter start index to a 64-element boundary"."""
MEGATRON_BUCKET_ALIGN = 128
"""distrib_optimizer.py _compute_per_buffer_param_layout: a bucket ends on a multiple of lcm(dp, 128)."""
DEEPSPEED_ALIGN = 2
"""stage_1_and_2.py nccl_start_alignment_factor."""
DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""zero/config.py reduce_bucket_size default (elements)."""
FP8_WEIGHT_CACHE_BYTES = 2
"""TE's cached fp8 weight, rowwise + columnwise, per block linear weight element (research notes Sec 2.5)."""
FP8_PARAM_BYTES = 1
"""A Float8Tensor parameter's rowwise data (Megatron's uint8 param buffer)."""
FP8_TRANSPOSE_BYTES = 1
"""Its columnwise copy for dgrad / wgrad: a materialised fp8 transpose on Hopper (research notes Sec 2.5)."""


def adam_state_tensors(optimizer: str) -> int:
    """fp32 states per master element: AdamW m and v, SGD momentum."""
    return 2 if optimizer == "adamw" else 1


def stack_model_state(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts,
                      unsharded: bool = True) -> ModelStateBytes:
    """The rank's params, grads and optimizer bytes as layout.stack keeps them (module docstring); unsharded=False:
    FSDP2 with nothing unsharded (memory/state_floor.py's resting state)."""
    s: StackMemory = layout.stack
    if s.mechanism == "megatron":
        def megatron(lay: Layout, pos: RankPosition, prt: RankParts, fsdp: bool) -> tuple[Num, Num, Num]:
            out = fsdp2_state(model, lay, pos, prt, unsharded) if fsdp else megatron_state(model, lay, pos, prt)
            return out.params_bytes, out.grads_bytes, out.optimizer_bytes
        return ModelStateBytes(*per_value(layout.fsdp, megatron, layout, position, parts))
    if s.mechanism == "fsdp2":
        return fsdp2_state(model, layout, position, parts, unsharded)
    return deepspeed_state(layout, parts)


# ---- Megatron-Core ----

def megatron_state(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> ModelStateBytes:
    """DDP buffers + DistributedOptimizer (zero1) or Float16OptimizerWithFloat16Params (ddp)."""
    s: StackMemory = layout.stack
    d = s.optimizer_group(layout)
    dist_opt = layout.zero_stage == ZeroStage.ZERO1
    experts = parts.total("ep_expert_numel")
    dense = megatron_aligned_numel(model, layout, position, parts)
    edp = ExpertLayout.of_layout(layout).edp  # the experts' buffer shards over Megatron's expert-data-parallel group
    dense_buf = megatron_buffer_numel(dense, d)
    expert_buf = where(experts > 0, megatron_buffer_numel(experts, edp), 0)
    local = parts.total("local_numel")
    numel = where(dist_opt, dense_buf + expert_buf, local)  # no padding without the distributed optimizer (M6)
    per_master = s.master_bytes + 4 * adam_state_tensors(layout.optimizer)
    owned = where(dist_opt, dense_buf / d + expert_buf / edp, local)
    return ModelStateBytes(params_bytes=megatron_param_bytes(layout, numel, parts.total("linear_weight_numel")),
                           grads_bytes=s.grad_bytes * numel, optimizer_bytes=per_master * owned)


def megatron_param_bytes(layout: Layout, numel: Num, linear: Num) -> Num:
    """The param buffer(s) of `numel` elements, `linear` of them block linear weights. fp8 params (--fp8-param-gather,
    param_dtype fp8): only TE's linear weights are Float8Tensors, in the uint8 buffer (1 B), and TE uses them as they
    are, no workspace (TransformerEngine d0067d0 module/base.py quantize_weight 835-845: "Already-quantized weight
    (primary FP8 parameters)"), adding their columnwise copy for the backward GEMMs (update_usage, module/linear.py
    1046-1051: the transpose on Hopper, 1 B); every other param (embedding, output layer, norms) stays in a 16-bit
    buffer (param_and_grad_buffer.py group_params_for_buffers: one buffer per param dtype). fp8 without fp8 params:
    16-bit params plus TE's cached fp8 weight workspace (module docstring)."""
    s: StackMemory = layout.stack
    if s.fp8_params:
        return FP8_PARAM_BYTES * linear + layout.compute_bytes * (numel - linear) + FP8_TRANSPOSE_BYTES * linear
    params = s.param_bytes * numel
    return params + FP8_WEIGHT_CACHE_BYTES * linear if s.fp8 else params


def megatron_buffer_numel(numel: Num, group: Num) -> Num:
    """A buffer of `numel` (64-aligned) elements ending on a multiple of lcm(group, 128)."""
    align = per_distinct(lambda g: math.lcm(int(g), MEGATRON_BUCKET_ALIGN), group)
    return ceil_div(numel, align) * align


def megatron_aligned_numel(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> Num:
    """The rank's non-expert local elements with every param start rounded up to 64 elements: per part, once per
    distinct (tp, ep, tp index, ep index, tied copy)."""
    key, st = model_key(model), parts.stages
    tied = tied_copy(model, layout)
    sums = per_distinct(lambda *row: _aligned_parts(key, *row), layout.tp, layout.ep, position.tp_index,
                        position.ep_index, tied)
    block, emb, head, alt = sums if isinstance(sums, tuple) else (sums[..., i] for i in range(4))
    return (st.n_blocks - st.n_alt) * block + st.n_alt * alt + st.first * emb + st.last * head


@lru_cache(maxsize=4096)
def _aligned_parts(key: ModelKey, tp: int, ep: int, tp_index: int, ep_index: int,
                   tied: int) -> tuple[int, int, int, int]:
    placement = (tp, 1, ep, 0, tp_index, 0, ep_index)
    out = []
    for part in ("block", "embeddings", "head", ALT_PART):
        if part == ALT_PART and not key_has_alt(key):
            out.append(0)
            continue
        params = local_part(key, part, bool(tied) and part == "head", placement)
        out.append(sum(-(-q.local_numel // MEGATRON_PARAM_ALIGN) * MEGATRON_PARAM_ALIGN for q in params
                       if not (q.is_expert and ep > 1)))
    return tuple(out)


def key_has_alt(key: ModelKey) -> bool:
    from backend.analytic.memory.parts import alt_layers

    return bool(alt_layers(key))


# ---- FSDP2 (torchtitan) ----

def fsdp2_state(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts,
                unsharded: bool = True) -> ModelStateBytes:
    """fully_shard with MixedPrecisionPolicy (zero2 / zero3); replicated (ddp / zero1) otherwise."""
    s: StackMemory = layout.stack
    per_state = 4 * adam_state_tensors(layout.optimizer) + s.master_bytes
    fsdp = layout.fsdp
    local = parts.total("local_numel")
    params = s.param_bytes * local
    grads = s.param_bytes * local
    zero1 = logical_and(layout.zero_stage == ZeroStage.ZERO1, layout.dp_cp > 1)
    optimizer = per_state * where(zero1, zero1_owned_numel(layout, parts), local)
    if any_true(fsdp):
        unsharded = unsharded_at_peak(model, layout, position.pp_rank, parts) if unsharded else UnshardedAtPeak(0, 0)
        storage = parts.total("storage_numel")
        cb = layout.compute_bytes  # MixedPrecisionPolicy.param_dtype: the run's 16-bit dtype (fp8: bf16 outside the
        # float8 GEMMs; torchao's fp8 all-gather of the linear weights, 1 B, is not counted)
        params = where(fsdp, s.param_bytes * storage + cb * unsharded.params_numel, params)
        # unsharded grads held between backwards (no gradient sync under pipelining) are accumulated in reduce_dtype
        # (_fsdp_param.py to_accumulated_grad_if_needed, called by post_backward when not reduce_grads)
        grads = where(fsdp, s.param_bytes * storage + s.grad_bytes * unsharded.grads_numel, grads)
        optimizer = where(fsdp, per_state * parts.total("real_numel"), optimizer)
    return ModelStateBytes(params, grads, optimizer)


def zero1_owned_numel(layout: Layout, parts: RankParts) -> Num:
    """The elements whose optimizer state a zero1 rank owns: the dense ones sharded over the optimizer group, ep's
    experts only over their expert-data-parallel group (the ranks holding the same experts, edp = dp x cp / ep:
    expert_layout.py), as the engine's zero1 and Megatron's distributed optimizer shard them."""
    experts = parts.total("ep_expert_numel")
    edp = ExpertLayout.of_layout(layout).edp
    return (parts.total("local_numel") - experts) / layout.stack.optimizer_group(layout) + experts / edp


# ---- DeepSpeed ZeRO ----

def deepspeed_state(layout: Layout, parts: RankParts) -> ModelStateBytes:
    """Stages 0-3 (module docstring)."""
    s: StackMemory = layout.stack
    n = s.optimizer_group(layout)
    stage = layout.zero_stage
    local = parts.total("local_numel")
    flat = ceil_div(local, DEEPSPEED_ALIGN * n) * DEEPSPEED_ALIGN * n  # stages 1-2: the padded flat buffer
    per_master = s.master_bytes + 4 * adam_state_tensors(layout.optimizer)
    pb = s.param_bytes
    bucket = DEEPSPEED_REDUCE_BUCKET * pb
    params = where(stage == ZeroStage.ZERO3, pb * ceil_div(local, n),
                   where(stage == ZeroStage.DDP, pb * local, pb * flat))
    grads = where(stage == ZeroStage.DDP, s.grad_bytes * local,
                  where(stage == ZeroStage.ZERO1, s.grad_bytes * flat,
                        where(stage == ZeroStage.ZERO2, s.grad_bytes * flat / n + bucket,
                              s.grad_bytes * ceil_div(local, n) + bucket)))
    owned = where(stage == ZeroStage.DDP, local, where(stage == ZeroStage.ZERO3, ceil_div(local, n), flat / n))
    return ModelStateBytes(params, grads, per_master * owned)


# ---- optimizer.step ----

def step_temp_bytes_of_stack(layout: Layout, state: ModelStateBytes) -> int:
    """optimizer.step's temporaries of a scalar stack rank: the foreach AdamW temporaries over the owned fp32 state
    (one flat shard per buffer: step_temp_bytes of one tensor) plus, with 16-bit grads and an fp32 master, the fp32
    copy of the shard's grads (Megatron _copy_model_grads_to_main_grads, DeepSpeed's single_grad_partition)."""
    s: StackMemory = layout.stack
    per_master = s.master_bytes + 4 * adam_state_tensors(layout.optimizer)
    owned = int(state.optimizer_bytes // per_master) if per_master else 0
    temp = step_temp_bytes([owned], layout.optimizer, foreach=layout.device == CUDA) if owned else 0
    if s.master_bytes and s.grad_bytes < 4 and s.mechanism != "fsdp2":
        temp += 4 * owned
    return int(temp)


def stack_memory_note(s: StackMemory) -> str:
    """What estimate says about a stack rank's memory terms."""
    master = f" + fp32 master {s.master_bytes} B" if s.master_bytes else ", no master copy"
    who = {"megatron": "Megatron-Core's param / grad buffers and DistributedOptimizer (zero1; ddp: "
                       "Float16OptimizerWithFloat16Params), padded as Megatron pads",
           "fsdp2": "FSDP2 with MixedPrecisionPolicy (sharded params and grads in param_dtype, the unsharded copy in "
                    "the 16-bit compute dtype)",
           "deepspeed": "DeepSpeed ZeRO's flat buffers, fp32 master partition and IPG bucket"}[s.mechanism]
    modules = ", ".join(sorted(s.recompute_modules)) or "no module"
    layer = (f"Transformer Engine's saved tensors per layer (memory/te_block.py; recompute selective checkpoints "
             f"{modules})" if s.te_layer and s.fused_attention else
             "compiled torch blocks without autocast (memory/compiled_block.py: what Inductor saves, eager terms "
             "outside its measured families)" if s.compiled_blocks else "eager torch blocks without autocast")
    if not s.textbook_selective and not (s.te_layer and s.fused_attention):
        layer += (f" (recompute_modules {modules} are priced on Transformer Engine blocks only: fused element-wise "
                  "work and a fused attention kernel, as on a GPU; selective here is the attention core)")
    loss = "vocab-parallel loss (logits / tp)" if s.loss_parallel else "full logits on every tp rank"
    return (f"memory as the stack keeps it (memory/stack_states.py, stack_activations.py): {who}; params "
            f"{s.param_bytes} B, grads {s.grad_bytes} B{master}, optimizer state sharded over "
            f"{'dp x cp' if s.optimizer_over_cp else 'dp'}; activations: {layer}, {loss}")
