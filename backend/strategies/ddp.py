"""Data parallelism with torch's DistributedDataParallel (every rank holds the full model; grads all-reduced)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from backend.models.gpt import loss_fn
from backend.strategies.base import LocalLoss, Prepared, RankContext, autocast, dp_slice, make_optimizer


def dp_group(ctx: RankContext):
    return ctx.mesh["dp"].get_group() if ctx.mesh is not None else None


def wrap_ddp(ctx: RankContext, model: nn.Module) -> nn.Module:
    """DDP over the dp mesh dimension; buckets double as .grad (gradient_as_bucket_view): one gradient copy."""
    if ctx.spec.parallel.dp == 1:
        return model
    kw = {"device_ids": [ctx.device.index]} if ctx.device.type == "cuda" else {}
    return DDP(model, process_group=dp_group(ctx), gradient_as_bucket_view=True, **kw)


def accumulate(ctx: RankContext, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward+backward over this rank's microbatches (no_sync on all but the last); returns the local mean loss."""
    t = ctx.spec.train
    x, y = dp_slice(inputs, ctx).to(ctx.device), dp_slice(targets, ctx).to(ctx.device)
    n, mb = t.microbatches, t.micro_batch
    total = torch.zeros((), device=ctx.device)
    for i in range(n):
        sync = nullcontext() if i == n - 1 or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(ctx.spec, ctx.device):
                logits = model(x[i * mb:(i + 1) * mb])  # (mb, T, V)
            loss = loss_fn(logits, y[i * mb:(i + 1) * mb]) / n
            loss.backward()
        total += loss.detach()
    return total


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    model = wrap_ddp(ctx, model.to(ctx.device))
    opt = make_optimizer(model.parameters(), ctx.spec)

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)  # keeps .grad as bucket views across steps: one copy
        local = accumulate(ctx, model, inputs, targets)
        opt.step()
        return LocalLoss(local)

    notes = ["DDP runs with gradient_as_bucket_view=True: .grad tensors are views of the all-reduce buckets, so gradients occupy one copy."]
    return Prepared(modules=[model], optimizer=opt, train_step=train_step, notes=notes)
