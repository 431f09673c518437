"""ZeRO stage 2: FSDP2 with reshard_after_forward=False (params stay unsharded from forward through backward;
gradients and optimizer state sharded)."""

from __future__ import annotations

from torch import nn

from backend.strategies.base import Prepared, RankContext
from backend.strategies.fsdp import prepare_sharded


def prepare(ctx: RankContext, model: nn.Module) -> Prepared:
    notes = ["ZeRO-2 = FSDP2 fully_shard per block + root with reshard_after_forward=False: one all-gather per "
             "unit and microbatch, unsharded parameters resident through backward, gradients reduce-scattered "
             "per microbatch."]
    return prepare_sharded(ctx, model, reshard_after_forward=False, notes=notes)
