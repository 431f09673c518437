"""`parallelize(ctx, model) -> Prepared`: every strategy and mix, applied in one fixed order (torchtitan's
`parallelize_*` shape; picotron's one-file-per-parallelism layout below it):

  0. pipeline split   (pp.py)          this rank's stage modules, cut from the meta model (a fresh meta GPT per
                                        extra stage); every later step applies to each stage module, as
                                        torchtitan's pipeline_llm does
  1. expert parallel  (ep.py)          experts sharded over ctx.ep_mesh()["ep"] (dp unflattened into dp_mod_ep x
                                        ep, strategies/ep_mesh.build_ep_mesh), all-to-all dispatch installed, in
                                        every stage module; whole experts on every tp rank (etp 1), or
                                        each split over the tp dim (etp = tp, by the TP step)
  2. tensor parallel  (tp.py)          DTensor `parallelize_module` with `tp_plan` (+ SP) over mesh["tp"]
  3. context parallel (cp.py)          positions and ring attention over ctx.cp_mesh()["cp"] (the batch's
                                        sequence share is cut by `local_batch`)
  4. activation checkpointing          gpt.set_recompute (backend/recompute_policy.py: block-level policies via
                                        models/checkpointing.py; selective: core attention)
  4b. torch.compile                    each block compiled in place under elementwise=compiled (compiled.py)
  5. data parallel, composable         FSDP2 fully_shard / replicate over mesh["dp"] (dp x cp ranks; data_parallel.py)
  6. device placement                  `materialize`: to_empty(ctx.device; the parameters on the host under
                                        offload=params, ctx.placement) + per-parameter seeded init of the
                                        local shard only (materialize.py); a model handed in built is moved
  7. data parallel, classic            the distributed optimizer (zero1 x tp/pp: parameters rebound to bucket
                                        views), tp grad hooks, DDP / ZeRO-1 (need real parameters), optimizer, step
  8. check                             every parameter / grad / buffer / DTensor shard where ctx.placement says

The engine owns placement of the batch too: `train_step` receives this dp rank's rows already on ctx.device.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from backend.models.gpt import MoE, set_recompute
from backend.strategies import compiled, float8
from backend.strategies import cp as context_parallel
from backend.strategies import data_parallel as dpar
from backend.strategies import pp as pipeline
from backend.strategies.context import Prepared, RankContext
from backend.strategies.ep import ExpertParallel
from backend.strategies.materialize import check_placement, is_meta, materialize
from backend.strategies.moe_stats import CapacityStats, moes
from backend.strategies.scaler import LossScaling
from backend.strategies.step import ExpertUsage, LoopStyle, MicrobatchStep, OptimizerTail
from backend.strategies.tp import apply_tp, register_grad_hooks
from backend.strategies.tp import notes as tp_notes

LOSS_NOTE = "Returned loss: one 16-byte all_reduce per step over the world (mean of the dp shares)."


def check_supported(ctx: RankContext) -> None:
    dpar.check_flavour(ctx.spec)


def parallelize(ctx: RankContext, model: nn.Module) -> Prepared:
    spec, p = ctx.spec, ctx.spec.parallel
    check_supported(ctx)
    meta = is_meta(model)
    if not meta:
        model.to(ctx.device)
    ids, mods = pipeline.build_stage_modules(ctx, model) if p.pp > 1 else ([0], [model])
    ep = ExpertParallel(ctx, mods) if p.ep > 1 else None
    shard = context_parallel.context_shard(ctx)
    n_compiled = 0
    for m in mods:
        float8.convert(spec, m, fsdp=dpar.uses_fsdp2(spec))  # torchtitan converts before parallelizing
        apply_tp(ctx, m)
        context_parallel.apply_cp(ctx, m, shard)
        set_recompute(m, spec.train.recompute, spec.train.sac_ops)
        n_compiled += compiled.compile_blocks(spec, m)
        dpar.composable_wrap(ctx, m, ignored=set(ep.params()) if ep else None)
        for sub in m.modules():
            if isinstance(sub, MoE):  # data-parallel reducers need every expert's grad on every rank
                sub.run_empty_experts = p.dp_cp > 1
    if meta:
        materialize(mods, ctx.placement, spec.train.seed)
    # rebinds every parameter to a view of its bucket: before any hook is registered on them
    experts = ep.params() if ep else []
    distributed = None
    if dpar.uses_distributed_optimizer(spec):
        distributed = dpar.distributed_optimizer(ctx, mods, experts, ep.replica_group if ep else None)
        if ep:
            ep.grads_by_optimizer = True
            experts = ep.params()  # rebound to bucket views
    if p.tp > 1:
        for m in mods:
            register_grad_hooks(m)
    usage = ExpertUsage(mods)
    extra: dict = {}
    capacity = moe_capacity_stats(ctx, mods, extra)
    mods = [dpar.classic_wrap(ctx, m, experts) for m in mods]
    opt = distributed or dpar.dp_optimizer(ctx, [q for m in mods for q in m.parameters()])
    float8.after_step(spec, mods, opt, fsdp=dpar.uses_fsdp2(spec))
    scaling = LossScaling(spec, ctx.device)  # fp16-mixed only; found-inf agreed over the world
    tail = OptimizerTail(mods, opt, usage, ep.sync_grads if ep else None, scaling=scaling, after_backward=capacity)
    timeline: list[dict] = []
    resident = list
    if p.pp > 1:
        step = pipeline.PipelineStep(ctx, ids, mods, tail, timeline, distributed=distributed)
        resident = step.recv_buffers  # before cp's wrapper below hides the step
    else:
        step = MicrobatchStep(mods[0], spec, ctx.device, tail, use_autocast=dpar.uses_autocast(spec),
                              style=loop_style(spec),
                              on_microbatch=ep.on_microbatch if ep else None, loss=compiled.loss_function(spec))
    if shard is not None:
        step = shard.measured(step, extra)  # per step: seconds waited on the ring's transfers (running record)
    if ep:
        ep.publish_to(extra)
    if scaling.enabled:
        extra["loss_scaling"] = scaling.report  # updated every step: skipped step indices, current scale
    prep = Prepared(modules=mods, optimizer=opt, train_step=step, fsdp=dpar.uses_fsdp2(spec), timeline=timeline,
                    notes=_notes(ctx, ids, ep, distributed) + compiled.notes(spec, n_compiled), extra=extra,
                    resident=resident)
    check_placement(ctx.placement, prep.modules, prep.optimizer)
    return prep


def moe_capacity_stats(ctx: RankContext, mods: list[nn.Module], extra: dict) -> CapacityStats | None:
    """The MoE layers' load-balancing loss over the cp shards, and the capacity limit's per-step record."""
    spec, p = ctx.spec, ctx.spec.parallel
    if spec.model.moe_aux_loss_coeff and p.cp > 1:
        group = ctx.cp_mesh()["cp"].get_group()
        for moe in moes(mods):
            moe.aux_group = group
    if spec.model.capacity_factor is None:
        return None
    return CapacityStats(spec, mods, extra, tokens=spec.train.micro_batch * spec.model.seq_len // p.cp)


def loop_style(spec) -> LoopStyle:
    p = spec.parallel
    if dpar.is_pure_dp(spec):
        return LoopStyle(hold_logits=dpar.uses_autocast(spec), loss_scaled_in_graph=True)
    if p.tp > 1:
        return LoopStyle(hold_logits=False, loss_scaled_in_graph=False)
    return LoopStyle(hold_logits=True, loss_scaled_in_graph=False)


def _notes(ctx: RankContext, ids: list[int], ep: ExpertParallel | None, distributed: Any = None) -> list[str]:
    p = ctx.spec.parallel
    out = dpar.notes(ctx.spec) + (distributed.notes() if distributed else [])
    if str(ctx.spec.train.precision) == "fp8":
        out += float8.NOTES
    if p.tp > 1:
        out += tp_notes(ctx.spec)
    out += context_parallel.notes(ctx)
    if ep:
        out += ep.notes()
    if p.pp > 1:
        out += pipeline.notes(ctx, ids)
        out.append("Returned loss: one 16-byte all_reduce per step over the world (last-stage microbatch means).")
    elif not dpar.is_pure_dp(ctx.spec):
        out.append(LOSS_NOTE)
    return out
