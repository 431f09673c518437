"""Expert parallelism (with data parallelism over the same ranks): DP×EP.

Groups (built with dist.new_group by every rank, in the same order): along the dp dimension of each
(pp, tp) column, ep groups are consecutive blocks of ep dp-ranks ({0..ep−1}, {ep..2ep−1}, ...); the
expert-replica groups join the ranks holding the same experts, one per block ({j, j+ep, j+2ep, ...}).

Per-rank parameters: every non-expert parameter (embeddings, attention, norms, routers, lm_head) in
full; experts: E/ep per MoE layer (ep rank j = dp mod ep owns experts j·E/ep .. (j+1)·E/ep − 1).

Gradients:
  non-expert: ddp -> classic DistributedDataParallel over mesh["dp"] with the expert params excluded
    from its reducer (one bucketed all-reduce per step, no_sync on earlier microbatches); zero2/zero3/fsdp ->
    fully_shard with the experts as ignored_params (`mp_common.dp_wrap`). Either way: mean over all dp ranks.
  experts: the all-to-all backward already sums, on the owning rank, the gradient of every token its
    ep group sent; one flat all_reduce(SUM) over the replica group adds the other blocks; dividing by dp
    gives the mean over the global batch, exactly the dense single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from backend.models.gpt import MoE, loss_fn
from backend.strategies import moe_dispatch
from backend.strategies import mp_common as mc
from backend.strategies.base import LocalLoss, Prepared, RankContext, autocast, dp_slice


def _rank_of(pp: int, d: int, t: int, dp: int, tp: int) -> int:
    return (pp * dp + d) * tp + t


def build_groups(ctx: RankContext) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this rank's ep group, its expert-replica group or None when dp == ep). Collective: every rank
    creates every group in the same order."""
    p = ctx.spec.parallel
    me = ctx.coords()
    ep_group = replica_group = None
    for pp in range(p.pp):
        for t in range(p.tp):
            for b in range(p.dp // p.ep):
                ranks = [_rank_of(pp, b * p.ep + j, t, p.dp, p.tp) for j in range(p.ep)]
                g = dist.new_group(ranks)
                if ctx.rank in ranks:
                    ep_group = g
            if p.dp == p.ep:
                continue
            for j in range(p.ep):
                ranks = [_rank_of(pp, b * p.ep + j, t, p.dp, p.tp) for b in range(p.dp // p.ep)]
                g = dist.new_group(ranks)
                if ctx.rank in ranks:
                    replica_group = g
    assert ep_group is not None, me
    return ep_group, replica_group


def apply_ep(ctx: RankContext, model: nn.Module, ep_group: dist.ProcessGroup,
             log: moe_dispatch.RoutingLog | None = None) -> list[nn.Parameter]:
    """Shard every MoE layer's experts over the ep group; returns this rank's expert parameters."""
    p = ctx.spec.parallel
    ep_rank = ctx.coords()["dp"] % p.ep
    expert_params: list[nn.Parameter] = []
    for name, block in model.layers.items():
        if isinstance(block.mlp, MoE):
            moe_dispatch.install(block.mlp, ep_group, p.ep, ep_rank, log, name)
            expert_params += list(block.mlp.experts.parameters())
    return expert_params


def sync_expert_grads(params: list[nn.Parameter], used: list[float], replica_group, dp: int,
                      device: torch.device) -> list[float]:
    """One flat all_reduce(SUM) over the expert-replica group, then / dp (see the module docstring).

    A 4-byte "ran this step" flag per expert tensor rides along; returns the flags summed over the replicas
    (0 = no token reached that expert anywhere: the optimizer must skip it, as in the dense reference).
    """
    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    flags = torch.tensor(used, device=device)  # same device as the grads: NCCL flattens them into one buffer
    flat = _flatten_dense_tensors(grads + [flags])
    if replica_group is not None:
        dist.all_reduce(flat, group=replica_group)
    *synced, flags = _unflatten_dense_tensors(flat, grads + [flags])
    for q, g in zip(params, synced):
        if q.grad is None:
            q.grad = g.div_(dp)
        else:
            q.grad.copy_(g).div_(dp)  # keep the persistent buffer
    return flags.tolist()


def ddp_without_experts(ctx: RankContext, model: nn.Module, experts: list[nn.Parameter]) -> nn.Module:
    """Classic DDP over the dp group for the non-expert params; the experts are excluded from its reducer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = {id(q) for q in experts}
    DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, q in model.named_parameters() if id(q) in ids])
    return DDP(model, process_group=ctx.mesh["dp"].get_group(), gradient_as_bucket_view=True)


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    spec = ctx.spec
    p = spec.parallel
    if p.tp > 1 or p.pp > 1:
        raise ValueError(f"ep with tp={p.tp} or pp={p.pp} is not supported: ep runs with dp only")
    ep_group, replica_group = build_groups(ctx)
    log = moe_dispatch.RoutingLog()
    experts = apply_ep(ctx, model, ep_group, log)
    usage = mc.ExpertUsage([model])
    if p.dp_flavour == "ddp":
        model, fsdp = ddp_without_experts(ctx, model, experts), False
    else:
        fsdp = mc.dp_wrap(ctx, model, ignored=set(experts))
    opt = mc.make_optimizer(spec, model.parameters())
    notes = [
        f"EP: {spec.model.n_experts // p.ep} of {spec.model.n_experts} experts per MoE layer on this rank; "
        f"expert grads all-reduced over {p.dp // p.ep} replica(s).",
        "Token dispatch: all_to_all of E int64 counts + 2 all_to_alls of routed rows per MoE layer and microbatch (x2 in backward).",
        "Returned loss: one 16-byte all_reduce per step over the world (mean of the dp shares).",
    ]

    def train_step(inputs, targets) -> float:
        xs = mc.split_microbatches(dp_slice(inputs, ctx), spec)
        ys = mc.split_microbatches(dp_slice(targets, ctx), spec)
        total = torch.zeros((), device=ctx.device)  # summed on the device: one host sync per step
        log.start_step()
        for i, (x, y) in enumerate(zip(xs, ys)):
            log.microbatch = i
            with mc.grad_sync(model, ctx, last=i == len(xs) - 1):
                with autocast(spec, ctx.device):
                    logits = model(x)
                loss = loss_fn(logits, y)
                (loss / len(xs)).backward()
            total += loss.detach().float()
        used = sync_expert_grads(experts, usage.flags(), replica_group, p.dp, ctx.device)
        hidden = usage.skip_unused(used)
        opt.step()
        opt.zero_grad(set_to_none=False)  # persistent grad buffers: grads resident all step (mp_common)
        usage.restore(hidden)
        prep.extra["moe_routing"] = routing_payload(ctx, log)  # the last step run is the memory-tracked one
        return LocalLoss(total / len(xs))

    prep = Prepared(modules=[model], optimizer=opt, train_step=train_step, fsdp=fsdp, notes=notes)
    return prep


def routing_payload(ctx: RankContext, log: moe_dispatch.RoutingLog) -> dict:
    """This rank's measured routing of its latest step (JSON): see backend/analytic/moe_routing.py."""
    m, p = ctx.spec.model, ctx.spec.parallel
    return {"ep": p.ep, "ep_rank": ctx.coords()["dp"] % p.ep, "n_experts": m.n_experts, "top_k": m.top_k,
            "tokens": ctx.spec.train.micro_batch * m.seq_len, "records": list(log.records)}
