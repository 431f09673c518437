"""ZeRO-3 / FSDP (and, via zero2.py, ZeRO-2): FSDP2 `fully_shard` per transformer block plus the root.

Gradients are reduce-scattered after every microbatch's backward (FSDP2's default), so they stay
sharded as ZeRO-2/3 intend; accumulating without sync would hold unsharded gradients instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from backend.models.gpt import loss_fn
from backend.strategies.base import LocalLoss, Prepared, RankContext, compute_dtype, dp_slice, make_optimizer

def mp_policy(ctx: RankContext) -> MixedPrecisionPolicy | None:
    dtype = compute_dtype(ctx.spec)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None


def shard(ctx: RankContext, model: nn.Module, *, reshard_after_forward: bool) -> nn.Module:
    kw = {"reshard_after_forward": reshard_after_forward}
    if ctx.mesh is not None:  # one rank: fully_shard's default mesh over the (size-1) world
        kw["mesh"] = ctx.mesh["dp"]
    if (mp := mp_policy(ctx)) is not None:
        kw["mp_policy"] = mp
    if str(ctx.spec.parallel.offload) == "params":  # issue 14 (i14): FSDP2 CPU offload; pinning needs an accelerator
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for layer in model.layers.values():
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def prepare_sharded(ctx: RankContext, model: nn.Module, *, reshard_after_forward: bool, notes: list[str]) -> Prepared:
    model = shard(ctx, model.to(ctx.device), reshard_after_forward=reshard_after_forward)
    opt = make_optimizer(model.parameters(), ctx.spec)
    t = ctx.spec.train

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)  # sharded grads stay resident (zeroed) like DDP's buckets
        x, y = dp_slice(inputs, ctx).to(ctx.device), dp_slice(targets, ctx).to(ctx.device)
        n, mb = t.microbatches, t.micro_batch
        total = torch.zeros((), device=ctx.device)
        for i in range(n):
            loss = loss_fn(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]) / n  # logits (mb, T, V)
            loss.backward()
            total += loss.detach()
        opt.step()
        return LocalLoss(total)

    return Prepared(modules=[model], optimizer=opt, train_step=train_step, fsdp=True, notes=notes)


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    notes = ["ZeRO-3/FSDP = FSDP2 fully_shard per block + root, reshard_after_forward=True: parameters are "
             "all-gathered before forward and again before backward, gradients reduce-scattered per microbatch."]
    return prepare_sharded(ctx, model, reshard_after_forward=True, notes=notes)
