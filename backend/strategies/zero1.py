"""ZeRO stage 1: optimizer state partitioned over the dp ranks (torch ZeroRedundancyOptimizer) on top of DDP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from backend.strategies.base import LocalLoss, Prepared, RankContext, make_optimizer, optimizer_class, optimizer_kwargs
from backend.strategies.ddp import accumulate, dp_group, wrap_ddp


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    model = wrap_ddp(ctx, model.to(ctx.device))
    if ctx.spec.parallel.dp == 1:  # one replica: nothing to partition (ZeRO would only broadcast to itself)
        opt = make_optimizer(model.parameters(), ctx.spec)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class(ctx.spec),
                                      process_group=dp_group(ctx), **optimizer_kwargs(ctx.spec))

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        model.zero_grad(set_to_none=False)  # keeps .grad as DDP bucket views: one gradient copy
        local = accumulate(ctx, model, inputs, targets)
        opt.step()  # local partition's update, then each parameter broadcast from its owner
        return LocalLoss(local)

    notes = ["ZeRO-1 = ZeroRedundancyOptimizer over DDP: whole parameters are assigned to ranks (greedy, largest "
             "first), so per-rank optimizer bytes are uneven; updated parameters are broadcast from their owners."]
    return Prepared(modules=[model], optimizer=opt, train_step=train_step, notes=notes)
