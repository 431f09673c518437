"""Pipeline parallelism with torch.distributed.pipelining, and its PP×DP, PP×TP and PP×DP×TP mixes.

Stage split (for the analytic model): S = pp · virtual_stages stages; L layers are cut into contiguous
runs, stage s gets floor(L/S) + (1 if s < L mod S else 0) layers (earlier stages take the extra layer).
Stage 0 also holds tok_emb + pos_emb, stage S−1 holds norm + lm_head.
Stage → rank (pp coordinate r, p = pp, v = virtual_stages):
  gpipe, 1f1b                      : stage r
  interleaved_1f1b, zero_bubble    : stages r, r + p, ..., r + (v−1)p   (looped placement)
  zbv, dualpipev                   : stages r and 2p − 1 − r            (V shape; rank 0 holds first and last)

Schedules: gpipe → ScheduleGPipe, 1f1b → Schedule1F1B, interleaved_1f1b → ScheduleInterleaved1F1B,
zero_bubble → ScheduleInterleavedZeroBubble, zbv → ScheduleZBVZeroBubble, dualpipev → ScheduleDualPipeV (its
OVERLAP_F_B pairs run their forward and backward one after the other in torch 2.13: no overlap). The schedule splits
this dp rank's rows into `microbatches` chunks; loss_fn (mean over a microbatch, times the fp16 loss scale:
`ScaledLoss`) runs on the last stage and scale_grads divides the accumulated grads by the microbatch count, so grads are
the dp-share mean.

PP×DP: each stage module gets the dp flavour on mesh["dp"] (`data_parallel.composable_wrap`: replicate for ddp,
fully_shard for zero2/zero3/fsdp; torchtitan's choice). The pipelining stages turn gradient sync off
for every microbatch and run the reduction once after the last backward, so every flavour reduces
gradients once per step under PP. PP×TP: the TP plan of tp.py is applied to each stage module first.

Stage modules are cut from a meta model (a fresh meta GPT per extra stage: no copy of any weight), then
parallelized and materialized like any other module (parallelize.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from backend.analytic.sharding import layer_split, stages_of_rank
from backend.models.gpt import build_model, loss_fn
from backend.spec import Schedule
from backend.strategies import timeline
from backend.strategies.compiled import loss_function
from backend.strategies.context import LocalLoss, RankContext, autocast
from backend.strategies.data_parallel import uses_autocast
from backend.strategies.distributed_optimizer import DistributedOptimizer
from backend.strategies.moe_stats import set_aux_loss_scale
from backend.strategies.step import OptimizerTail

if TYPE_CHECKING:
    from backend.strategies.scaler import LossScaling

SCHEDULES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    Schedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    Schedule.ZBV: ScheduleZBVZeroBubble,
    Schedule.DUALPIPEV: ScheduleDualPipeV,
}
SINGLE_STAGE = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
GRAPH_EXEC_GROUP = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
"""Public in torch 2.13's torch.utils.checkpoint; a torch without it keeps the per-group re-runs."""


class WeightPassStage(PipelineStage):
    """A PipelineStage whose weight pass (zero bubble, ZBV, DualPipeV: `backward_weight_one_chunk`) is one
    `GraphExecGroup`. torch 2.13's `stage_backward_weight` (pipelining/_backward.py) calls `autograd.grad` once per
    parameter group, and a non-reentrant checkpoint recomputes its block once per graph task: without the group every
    weight matrix re-ran its checkpointed block, and each re-run's tensors that nobody unpacks stayed alive until the
    chunk's graph died (a CPU stage of 4 d256 blocks under full recompute: 85.9 MB at the weight pass's peak, 35.0 MB
    with the group). The groups' `autograd.grad` calls read disjoint saved tensors, as the group requires. The input
    pass cannot join it: both passes read the same matmul node's saved inputs."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with GRAPH_EXEC_GROUP() if GRAPH_EXEC_GROUP is not None else nullcontext():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous layer indices per stage, exactly as the analytic model splits them (sharding.layer_split)."""
    return [list(r) for r in layer_split(n_layers, n_stages)]


def strip_to_stage(model: nn.Module, s: int, n_stages: int, layers: list[int]) -> nn.Module:
    """Delete everything stage s does not own (GPT.forward skips None modules)."""
    if s != 0:
        model.tok_emb = None
        model.pos_emb = None
    if s != n_stages - 1:
        model.norm = None
        model.lm_head = None
    keep = {str(i) for i in layers}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    return model


def build_stage_modules(ctx: RankContext, model: nn.Module) -> tuple[list[int], list[nn.Module]]:
    """This rank's stage ids and their modules. From a meta model each extra stage is a fresh meta GPT (free);
    a model handed in already built (tests, benchmarks) is copied for all but its last stage."""
    p = ctx.spec.parallel
    n_stages = p.pp * p.virtual_stages
    ids = stages_of_rank(ctx.coords()["pp"], p.pp, p.virtual_stages, p.pp_schedule)
    split = stage_layers(ctx.spec.model.n_layers, n_stages)
    meta = any(q.is_meta for q in model.parameters())
    extra = [build_model(ctx.spec.model, seed=ctx.spec.train.seed, recompute=ctx.spec.train.recompute, device="meta")
             if meta else copy.deepcopy(model) for _ in ids[:-1]]
    return ids, [strip_to_stage(m, s, n_stages, split[s]) for m, s in zip(extra + [model], ids, strict=False)]


def tied_embedding_sync(ctx: RankContext, ids: list[int], mods: list[nn.Module], grad_of=None):
    """Tied embeddings across stages, as Megatron-LM does (`_allreduce_word_embedding_grads`): the first stage
    holds tok_emb.weight, the last stage its own copy as lm_head.weight; after backward their gradients are summed
    (one all_reduce of the local (V/t, h) grad over {first-stage rank, last-stage rank} of each (dp, tp) column, or a
    local add when one rank holds both stages, as ZBV's V shape does) so both copies take the same optimizer step.
    Collective at build time: every rank creates every pair group in the same order. Returns the per-step call.
    grad_of(param): where its gradient lives (default `.grad`; the distributed optimizer's main-grad view)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    p = ctx.spec.parallel
    n_stages = p.pp * p.virtual_stages
    holder = [r for r in range(p.pp) if n_stages - 1 in stages_of_rank(r, p.pp, p.virtual_stages, p.pp_schedule)][0]
    me = ctx.coords()
    mine = p.data_parallel_index(ctx.rank)  # the (dp, cp) column: dp x cp ranks hold each stage's copy
    group = None
    if holder != 0:
        for d in range(p.dp_cp):
            for t in range(p.tp):
                pair = [d * p.tp + t, (holder * p.dp_cp + d) * p.tp + t]
                g = dist.new_group(pair)
                if mine == d and me["tp"] == t and me["pp"] in (0, holder):
                    group = g
    copies = [m.tok_emb.weight for m in mods if m.tok_emb is not None]
    copies += [m.lm_head.weight for m in mods if m.lm_head is not None and m.tok_emb is None]

    def local(g):
        return g.to_local() if isinstance(g, DTensor) else g

    grad_of = grad_of or (lambda q: q.grad)

    def sync() -> None:
        grads = [local(g) for g in map(grad_of, copies) if g is not None]
        if len(grads) == 2:  # both stages on this rank (ZBV): add locally
            total = grads[0] + grads[1]
            grads[0].copy_(total)
            grads[1].copy_(total)
        elif len(grads) == 1 and group is not None:
            dist.all_reduce(grads[0], group=group)

    return sync


def _cpu_note(ctx: RankContext) -> str:
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    return (f"Bubble: {ctx.world_size} ranks on {cores} CPU cores at load average {load:.1f}; when the ranks do not "
            "each get a core, stages time-share the CPU and cannot overlap, so the measured bubble tends to "
            "1 - 1/pp whatever the schedule." if ctx.device.type == "cpu" else "")


def notes(ctx: RankContext, ids: list[int]) -> list[str]:
    spec, p = ctx.spec, ctx.spec.parallel
    n_stages = p.pp * p.virtual_stages
    return [f"PP {p.pp_schedule}: stages {ids} of {n_stages} on this rank; layers "
            f"{stage_layers(spec.model.n_layers, n_stages)}.",
            f"Timeline: call {timeline.capture_call(spec.train.warmup_steps, spec.train.steps)} of train_step (a timed "
            "step after the first, which may still run lazy initialisation) is recorded.",
            *filter(None, [_cpu_note(ctx)])]


class ScaledLoss:
    """The schedule's loss_fn: the microbatch's mean loss, times the fp16 loss scale (identity otherwise), so the
    backward the schedule runs from it is scaled exactly as the microbatch loop's (strategies/scaler.py)."""

    def __init__(self, scaling: LossScaling, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn):
        self.scaling, self.loss = scaling, loss

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.scaling.scale(self.loss(logits, targets))


class PipelineStep:
    """One optimizer step through the pipeline schedule; records the timeline of the first timed step."""

    def __init__(self, ctx: RankContext, ids: list[int], mods: list[nn.Module], tail: OptimizerTail,
                 timeline_out: list[dict], distributed: DistributedOptimizer | None = None):
        p = ctx.spec.parallel
        n_stages = p.pp * p.virtual_stages
        group = ctx.mesh["pp"].get_group()
        stages = [WeightPassStage(m, s, n_stages, ctx.device, group=group) for s, m in zip(ids, mods, strict=False)]
        cls = SCHEDULES[p.pp_schedule]
        # the distributed optimizer divides its main grads by the microbatch count itself (the schedule would scale
        # only the .grad a split-backward weight pass leaves, before the optimizer sweeps them in)
        self.schedule = cls(stages[0] if p.pp_schedule in SINGLE_STAGE else stages,
                            n_microbatches=ctx.spec.train.microbatches,
                            loss_fn=ScaledLoss(tail.scaling, loss_function(ctx.spec)),
                            scale_grads=distributed is None)
        self.use_autocast = uses_autocast(ctx.spec)
        self.stages = stages
        self.ctx, self.tail, self.timeline, self.mods = ctx, tail, timeline_out, mods
        self.first, self.last = 0 in ids, n_stages - 1 in ids
        self.calls = 0
        self.record_call = timeline.capture_call(ctx.spec.train.warmup_steps, ctx.spec.train.steps)
        self.sync_tied = (tied_embedding_sync(ctx, ids, mods, grad_of=distributed.main_grad if distributed else None)
                          if ctx.spec.model.tie_embeddings else None)

    def recv_buffers(self) -> list[torch.Tensor]:
        """The stages' receive buffers: one per microbatch for each stage input (`args_recv_info`) and each output
        gradient (`grad_recv_info`), which torch allocates in the first step and keeps (stage.py
        `_create_act_recv_info`, `_create_grad_recv_info`); a V schedule's same-rank hand-over rebinds them
        (`set_local_fwd_input`, `set_local_bwd_input`) to tensors that also stay until the next."""
        infos = [i for s in self.stages for by_mb in (s.args_recv_info, s.grad_recv_info) for t in by_mb.values()
                 for i in t]
        return [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]

    def _run_schedule(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        args = (x,) if self.first else ()
        if self.ctx.spec.model.moe_aux_loss_coeff:  # the schedule divides the grads by the microbatches afterwards
            set_aux_loss_scale(self.mods, self.tail.scaling.scale_value())
        with autocast(self.ctx.spec, self.ctx.device) if self.use_autocast else nullcontext():
            # return_outputs=False: the last stage would otherwise keep every microbatch's logits (b, s, V)
            # alive until the step ends, only to concatenate them for a return value we do not use.
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.last:
            return 0.0
        # the schedule keeps what loss_fn returned (scaled under fp16); the scale is a power of two: exact
        return sum(float(v.detach()) for v in losses) / len(losses) / self.tail.scaling.scale_value()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> LocalLoss:
        if self.calls == self.record_call:
            self.timeline.clear()
            with timeline.capture(self.timeline, step=self.calls, device=self.ctx.device):
                local = self._run_schedule(x, y)
        else:
            local = self._run_schedule(x, y)
        self.calls += 1
        if self.sync_tied is not None:
            self.sync_tied()
        self.tail()
        return LocalLoss(local, 1.0 if self.last else 0.0)
