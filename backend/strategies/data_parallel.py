"""The data-parallel flavour on the dp mesh dimension: every wrapper ShardLab uses, in one place.

| flavour      | alone (no tp/pp/ep)                       | in a tp / pp mix           | with ep                      |
|--------------|-------------------------------------------|----------------------------|------------------------------|
| ddp          | DistributedDataParallel,                  | FSDP2-style `replicate`    | DDP with the experts left    |
|              | gradient_as_bucket_view                   | per block + root           | out of its reducer (tp / pp  |
|              |                                           |                            | mixes: replicate, experts    |
|              |                                           |                            | ignored)                     |
| zero1        | ZeroRedundancyOptimizer over DDP          | Megatron's distributed     | the distributed optimizer,   |
|              |                                           | optimizer                  | experts in buckets of their  |
|              |                                           | (distributed_optimizer.py) | own over the edp group       |
| zero2        | fully_shard(reshard_after_forward=False), | same, no mp_policy         | same, experts as             |
|              | mp_policy                                 | (autocast instead)         | ignored_params               |
| zero3 / fsdp | fully_shard(reshard_after_forward=True),  | same, no mp_policy         | same, experts as             |
|              | mp_policy                                 | (autocast instead)         | ignored_params               |

Classic DDP does not take DTensor (TP) parameters and the pipelining stages drive `replicate`/`fully_shard`
modules through their own hooks, hence `replicate` in tp/pp mixes (torchtitan's choice). The FSDP2-style
wrappers are applied to meta modules before materialization (`composable_wrap`); classic DDP and ZeRO-1 need
real parameters (DDP broadcasts them at construction) and come after it (`classic_wrap`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from backend.spec import ExperimentSpec, Strategy
from backend.spec.stack_rules import megatron_distributed_optimizer
from backend.strategies.context import RankContext, compute_dtype, make_optimizer, optimizer_class, optimizer_kwargs
from backend.strategies.distributed_optimizer import DistributedOptimizer
from backend.torch_compat import ddp_ignore_params, replicate

SHARDED = (Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP)


def is_pure_dp(spec: ExperimentSpec) -> bool:
    p = spec.parallel
    return p.tp == 1 and p.pp == 1 and p.ep == 1


def uses_fsdp2(spec: ExperimentSpec) -> bool:
    """FSDP2 `fully_shard` / `replicate` wraps the modules (the engine then tracks memory with FSDPMemTracker)."""
    p = spec.parallel
    if p.dp_flavour in SHARDED:
        return p.dp_cp > 1 or is_pure_dp(spec)
    return p.dp_cp > 1 and p.dp_flavour == Strategy.DDP and (p.tp > 1 or p.pp > 1)


def uses_autocast(spec: ExperimentSpec) -> bool:
    """Pure ZeRO-2/3 casts with FSDP2's MixedPrecisionPolicy, the distributed optimizer keeps 16-bit params (the
    module runs in that dtype); every other layout runs the step under autocast."""
    if uses_distributed_optimizer(spec) and compute_dtype(spec) is not None:
        return False
    return not (is_pure_dp(spec) and spec.parallel.dp_flavour in SHARDED)


def uses_distributed_optimizer(spec: ExperimentSpec) -> bool:
    """zero1 on the dp dimension of a tp / pp / ep mix, or any zero1 of the megatron stack (its memory layout as an
    engine option: bf16 params, an fp32 main-grad buffer, fp32 master and Adam state over dp x cp;
    spec/stack_rules.megatron_distributed_optimizer): Megatron's distributed optimizer (distributed_optimizer.py;
    with ep its expert buckets shard over the expert data-parallel group). The same rule as the prediction's
    (analytic/dp_buckets.used_by)."""
    p = spec.parallel
    return p.dp_flavour == Strategy.ZERO1 and (p.tp > 1 or p.pp > 1 or p.ep > 1 or megatron_distributed_optimizer(spec))


def check_flavour(spec: ExperimentSpec) -> None:
    del spec  # every flavour runs with every degree now (zero1 x ep: the distributed optimizer's expert buckets)


def blocks(module: nn.Module) -> list[nn.Module]:
    layers = getattr(module, "layers", None)
    return list(layers.values()) if layers is not None else []


def mp_policy(spec: ExperimentSpec) -> MixedPrecisionPolicy | None:
    dtype = compute_dtype(spec)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None


def composable_wrap(ctx: RankContext, module: nn.Module, ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2 `fully_shard` / `replicate` per transformer block, then the root, over mesh["dp"] (works on meta)."""
    spec = ctx.spec
    if not uses_fsdp2(spec):
        return
    flavour = spec.parallel.dp_flavour
    kw: dict = {"mesh": ctx.mesh["dp"]} if ctx.mesh is not None else {}
    if ignored:
        kw["ignored_params"] = ignored
    if flavour == Strategy.DDP:
        wrap = replicate
    else:
        wrap = fully_shard
        kw["reshard_after_forward"] = flavour != Strategy.ZERO2
        if is_pure_dp(spec) and (mp := mp_policy(spec)) is not None:
            kw["mp_policy"] = mp
        if str(spec.parallel.offload) == "params":  # FSDP2 CPU offload (issue 14); pinning needs an accelerator
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for b in blocks(module):
        wrap(b, **kw)
    wrap(module, **kw)


def classic_wrap(ctx: RankContext, model: nn.Module, experts: list[nn.Parameter]) -> nn.Module:
    """DistributedDataParallel over mesh["dp"] for pure ddp / zero1 and for ddp with ep (experts excluded from the
    reducer: their grads are reduced over the expert-replica group instead); needs materialized parameters."""
    p = ctx.spec.parallel
    if p.dp_cp == 1 or p.dp_flavour not in (Strategy.DDP, Strategy.ZERO1) or p.tp > 1 or p.pp > 1 \
            or uses_distributed_optimizer(ctx.spec):
        return model
    if experts:
        ids = {id(q) for q in experts}
        ddp_ignore_params(model, [n for n, q in model.named_parameters() if id(q) in ids])
    kw = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}
    return DDP(model, process_group=ctx.mesh["dp"].get_group(), gradient_as_bucket_view=True, **kw)


def distributed_optimizer(ctx: RankContext, modules: list[nn.Module], experts: list[nn.Parameter] | None = None,
                          expert_group=None) -> DistributedOptimizer:
    """Megatron's distributed optimizer over mesh["dp"] for the materialized stage modules (rebinds their
    parameters to bucket views: build it before any hook is registered on them); with ep the experts' buckets over
    `expert_group` (the expert data-parallel group; None: edp = 1, nothing to shard)."""
    spec, p = ctx.spec, ctx.spec.parallel
    pipelined = p.pp > 1
    tied = ("tok_emb.weight", "lm_head.weight") if pipelined and spec.model.tie_embeddings else ()
    return DistributedOptimizer(modules,
                                make_inner=lambda masters: optimizer_class(spec)(masters, **optimizer_kwargs(spec)),
                                dp_group=ctx.mesh["dp"].get_group(), tp_group=ctx.mesh["tp"].get_group(),
                                microbatches=spec.train.microbatches or 1,
                                grad_divisor=p.dp_cp * (spec.train.microbatches if pipelined else 1),
                                param_dtype=compute_dtype(spec) or torch.float32, held_names=tied,
                                experts=set(map(id, experts or [])), expert_group=expert_group)


def dp_optimizer(ctx: RankContext, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """ZeRO-1 partitions the optimizer state over the dp ranks; every other flavour uses the plain optimizer."""
    spec = ctx.spec
    if spec.parallel.dp_flavour == Strategy.ZERO1 and spec.parallel.dp_cp > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class(spec),
                                       process_group=ctx.mesh["dp"].get_group(), **optimizer_kwargs(spec))
    return make_optimizer(params, spec)


def notes(spec: ExperimentSpec) -> list[str]:
    p = spec.parallel
    flavour, pure = p.dp_flavour, is_pure_dp(spec)
    if pure and flavour == Strategy.DDP:
        return ["DDP runs with gradient_as_bucket_view=True: .grad tensors are views of the all-reduce buckets, "
                "so gradients occupy one copy."]
    if pure and flavour == Strategy.ZERO1:
        return ["ZeRO-1 = ZeroRedundancyOptimizer over DDP: whole parameters are assigned to ranks (greedy, largest "
                "first), so per-rank optimizer bytes are uneven; updated parameters are broadcast from their owners."]
    if pure and flavour == Strategy.ZERO2:
        return ["ZeRO-2 = FSDP2 fully_shard per block + root with reshard_after_forward=False: one all-gather per "
                "unit and microbatch, unsharded parameters resident through backward, gradients reduce-scattered "
                "per microbatch."]
    if pure:
        return ["ZeRO-3/FSDP = FSDP2 fully_shard per block + root, reshard_after_forward=True: parameters are "
                "all-gathered before forward and again before backward, gradients reduce-scattered per microbatch."]
    if p.dp_cp > 1 and flavour == Strategy.DDP and p.tp > 1:
        return ["DDP×TP: dp replication by replicate_with_fsdp (FSDP2-style DDP that takes DTensor params); "
                "it keeps a replica and an unsharded compute copy of every parameter (2x parameter bytes)."]
    return []
