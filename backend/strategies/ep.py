"""Expert parallelism (with data parallelism over the same ranks): DP×EP.

Mesh: the dp dimension of ctx.mesh (pp, dp, tp) is unflattened into the named dims (dp_mod_ep, ep) =
(dp/ep, ep), row-major, ep fastest (`ctx.ep_mesh()`, strategies/ep_mesh.build_ep_mesh, torchtitan's dp_shard_mod_ep x
dp_shard_in_ep): ep groups are consecutive blocks of ep dp-ranks ({0..ep−1}, {ep..2ep−1}, ...); the
expert-replica groups (dp_mod_ep) join the ranks holding the same experts, one per block ({j, j+ep, j+2ep, ...}).

Per-rank parameters: every non-expert parameter (embeddings, attention, norms, routers, lm_head) in
full; experts: E/ep per MoE layer (ep rank j = dp mod ep owns experts j·E/ep .. (j+1)·E/ep − 1).

Gradients:
  non-expert: ddp -> classic DistributedDataParallel over mesh["dp"] with the expert params excluded
    from its reducer (one bucketed all-reduce per step, no_sync on earlier microbatches); zero2/zero3/fsdp ->
    fully_shard with the experts as ignored_params (`data_parallel`). Either way: mean over all dp ranks.
  experts: the all-to-all backward already sums, on the owning rank, the gradient of every token its
    ep group sent; an all_reduce(SUM) over the replica group (25 MB buckets) adds the other blocks; dividing by dp
    gives the mean over the global batch, exactly the dense single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from backend.analytic.traffic import DDP_BUCKET_BYTES
from backend.models.gpt import MoE
from backend.strategies import moe_dispatch
from backend.strategies.context import RankContext
from backend.torch_compat import flatten_dense_tensors, unflatten_dense_tensors


def expert_groups(ctx: RankContext) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this rank's ep group, its expert-replica group or None when dp == ep): the named dims "ep" and "dp_mod_ep"
    of ctx.ep_mesh() (strategies/ep_mesh.build_ep_mesh; fresh ep groups: DDP's gradient all-reduce and the dispatch
    all-to-all must not share a gloo group)."""
    p = ctx.spec.parallel
    mesh = ctx.ep_mesh()
    return mesh["ep"].get_group(), (mesh["dp_mod_ep"].get_group() if p.dp_cp > p.ep else None)


class ExpertParallel:
    """Shards every MoE layer's experts over ep_mesh["ep"] and reduces their grads over ep_mesh["dp_mod_ep"] (the
    distributed optimizer reduce-scatters them over that group itself: `grads_by_optimizer`)."""

    def __init__(self, ctx: RankContext, modules: list[nn.Module]):
        p = ctx.spec.parallel
        self.ctx, self.modules = ctx, modules
        self.extra: dict = {}
        ep_group, self.replica_group = expert_groups(ctx)
        self.ep_rank = dist.get_rank(ep_group)
        self.log = moe_dispatch.RoutingLog()
        self.moes: list[MoE] = []
        self.grads_by_optimizer = False
        for module in modules:
            for name, block in module.layers.items():
                if isinstance(block.mlp, MoE):
                    moe_dispatch.install(block.mlp, ep_group, p.ep, self.ep_rank, self.log, name)
                    self.moes.append(block.mlp)
        if p.pp > 1:  # the schedule runs each stage's forwards in microbatch order: count them per stage
            self.forwards = [0] * len(modules)
            for i, module in enumerate(modules):
                module.register_forward_pre_hook(self._stage_forward(i))

    def _stage_forward(self, i: int):
        def hook(module: nn.Module, args) -> None:
            self.log.microbatch = self.forwards[i]
            self.forwards[i] += 1
        return hook

    def params(self) -> list[nn.Parameter]:
        """This rank's expert parameters (the live objects: call again after materialization)."""
        return [q for moe in self.moes for q in moe.experts.parameters()]

    def on_microbatch(self, i: int) -> None:
        if i == 0:
            self.log.start_step()
        self.log.microbatch = i

    def publish_to(self, extra: dict) -> None:
        """Each step's routing replaces extra["moe_routing"] (engine/loop.py keeps the memory-tracked step's)."""
        self.extra = extra

    def sync_grads(self, used: list[float]) -> list[float]:
        """After the last backward (OptimizerTail): expert grads over the replicas (unless the distributed optimizer
        reduce-scatters them); records this step's routing."""
        p = self.ctx.spec.parallel
        if self.grads_by_optimizer:
            flags = used
        else:
            flags = sync_expert_grads(self.params(), used, self.replica_group, p.dp_cp, self.ctx.device)
        self.extra["moe_routing"] = self.routing_payload()
        if p.pp > 1:
            self.log.start_step()
            self.forwards = [0] * len(self.modules)
        return flags

    def notes(self) -> list[str]:
        m, p = self.ctx.spec.model, self.ctx.spec.parallel
        how = ("reduce-scattered by the distributed optimizer" if self.grads_by_optimizer else "all-reduced")
        return [f"EP: {m.n_experts // p.ep} of {m.n_experts} experts per MoE layer on this rank"
                + ((f", split colwise / rowwise over the {p.tp} tp ranks (etp {p.etp})" if p.etp > 1 else
                    f", whole on each of the {p.tp} tp ranks (etp 1)") if p.tp > 1 else "")
                + f"; expert grads {how} over {p.dp_cp // p.ep} replica(s) (edp).",
                "Token dispatch: all_to_all of E int64 counts + 2 all_to_alls of routed rows per MoE layer and "
                "microbatch (x2 in backward)."]

    def routing_payload(self) -> dict:
        """This rank's measured routing of its latest step (JSON): see backend/analytic/measured/moe_routing.py."""
        m, p = self.ctx.spec.model, self.ctx.spec.parallel
        return {"ep": p.ep, "ep_rank": self.ep_rank, "n_experts": m.n_experts, "top_k": m.top_k,
                "tokens": self.ctx.spec.train.micro_batch * m.seq_len // p.cp, "records": list(self.log.records)}


EXPERT_BUCKET_BYTES = DDP_BUCKET_BYTES
"""Expert-gradient all-reduce buckets, DDP's bucket_cap_mb=25 (the step-time model counts them alike): the flat copy
alive during the sync is one bucket, not every expert gradient of the rank (17 GB for a 7B-class MoE at ep 8)."""


def sync_expert_grads(params: list[nn.Parameter], used: list[float], replica_group, dp: int,
                      device: torch.device) -> list[float]:
    """all_reduce(SUM) over the expert-replica group, then / dp (see the module docstring).

    Buckets of at most EXPERT_BUCKET_BYTES in parameter order (a lone tensor is reduced in place); a 4-byte
    "ran this step" flag per expert tensor rides in the last bucket. Without replicas (dp == ep) nothing is sent
    or copied. Returns the flags summed over the replicas (0 = no token reached that expert anywhere: the
    optimizer must skip it, as in the dense reference).
    """
    grads = []
    for q in params:
        if q.grad is None:
            q.grad = torch.zeros_like(q)
        grads.append(q.grad)
    flags = torch.tensor(used, device=device)  # same device as the grads: NCCL flattens them into one buffer
    if replica_group is not None:
        buckets = _buckets(grads, EXPERT_BUCKET_BYTES)
        buckets[-1].append(flags)
        for bucket in buckets:
            if len(bucket) == 1:
                dist.all_reduce(bucket[0], group=replica_group)
                continue
            flat = flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=replica_group)
            for t, synced in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=False):
                t.copy_(synced)
    for g in grads:
        g.div_(dp)
    return flags.tolist()


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped while the group stays within cap_bytes (at least one per group, one empty group
    for no tensors)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out
