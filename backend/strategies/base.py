"""The one entry the engine calls: `prepare(ctx, model) -> Prepared` (backend/strategies/parallelize.py does the
work). The shared types live in context.py and are re-exported here for the engine, tests and benchmarks."""

from __future__ import annotations

from torch import nn

from backend.strategies.context import (  # noqa: F401 - re-exported
    LocalLoss,
    Prepared,
    RankContext,
    autocast,
    compute_dtype,
    dp_slice,
    global_mean_loss,
    local_batch,
    make_optimizer,
    optimizer_class,
    optimizer_kwargs,
)
from backend.strategies.parallelize import parallelize


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    """Parallelize `model` for this rank (see parallelize.py). A model on the meta device is materialized shard by
    shard; a built one is moved to ctx.device first."""
    return parallelize(ctx, model)
