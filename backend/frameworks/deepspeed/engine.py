"""DeepSpeed's engine around ShardLab's seeded GPT: `prepare(ctx, model) -> Prepared`, like a strategy file.

The engine owns partitioning, communication and the optimizer step (`engine.backward`, `engine.step`);
ShardLab only feeds it this rank's microbatches and reads its state for measurement.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backend.frameworks.deepspeed.ds_config import ds_config
from backend.models.gpt import loss_fn
from backend.strategies.base import LocalLoss, Prepared, RankContext, make_optimizer


def skip_shm_build() -> None:
    """DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce (g++, 1-7 min here) when it starts,
    used only by `inference_all_reduce`, which training never calls: mark the op incompatible so it is not built.
    Training collectives go through torch.distributed (gloo) either way, where ShardLab counts them."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize(ctx: RankContext, model: nn.Module) -> tuple[Any, dict[str, Any]]:
    import deepspeed

    skip_shm_build()

    cfg = ds_config(ctx.spec)
    opt = make_optimizer(model.parameters(), ctx.spec)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
    return engine, cfg


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The client torch optimizer that holds the Adam/SGD state (ZeRO wraps it; stage 0 fp32 uses it as is)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
"""Where DeepSpeed 0.19.8 keeps the fp32 master partitions: ZeRO-1/2, ZeRO-3, the BF16 optimizer (stage 0)."""


def master_tensors(engine: Any) -> list[torch.Tensor]:
    """The fp32 master partitions the optimizer steps on (a separate copy from the module's parameters in ZeRO
    stages 1-3 and under bf16/fp16); [] when the optimizer steps on the module's own parameters."""
    for attr in MASTER_ATTRS:
        found = getattr(engine.optimizer, attr, None)
        if found:
            return [t for t in found if isinstance(t, torch.Tensor) and t.numel()]
    module_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters() if p.numel()}
    out = []
    for group in inner_optimizer(engine).param_groups:
        for q in group["params"]:
            if q.numel() and q.untyped_storage().data_ptr() not in module_storages:
                out.append(q)
    return out


def prepare(ctx: RankContext, model: nn.Module) -> tuple[Prepared, Any]:
    """(Prepared for the engine's loop, the DeepSpeed engine)."""
    engine, cfg = initialize(ctx, model)
    t = ctx.spec.train

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> LocalLoss:
        x, y = inputs, targets  # this dp rank's rows, already on ctx.device (the engine owns placement)
        n, mb = t.microbatches, t.micro_batch
        total = torch.zeros((), device=ctx.device)
        for i in range(n):
            loss = loss_fn(engine(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb])  # logits (mb, T, V)
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += loss.detach().float() / n
        return LocalLoss(total)

    notes = [f"DeepSpeed {_version()} ZeRO stage {cfg['zero_optimization']['stage']}"
             + (f", offload {ctx.spec.parallel.offload} to CPU" if ctx.spec.parallel.offload != "none" else "")
             + ": the engine partitions and communicates; buckets "
             f"{cfg['zero_optimization']['reduce_bucket_size']:.0e} elements; client torch optimizer (not DeepSpeed's "
             "JIT-built CPU Adam)."]
    prep = Prepared(modules=[engine.module], optimizer=inner_optimizer(engine), train_step=train_step, notes=notes,
                    extra={"ds_config": cfg})
    return prep, engine


def _version() -> str:
    import deepspeed

    return deepspeed.__version__


def partitions(engine: Any) -> list[torch.Tensor]:
    """ZeRO-3's per-parameter partitions (`ds_tensor`), which the module's parameters only point to."""
    return [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
