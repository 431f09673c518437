"""The parallelism section of a spec: the strategy, the world, and every degree of the dimension table
(backend/spec/dims.py) with the mesh arithmetic over them."""

from __future__ import annotations

from pydantic import Field

from backend.spec import dims
from backend.spec.choices import (
    DP_FLAVOURS,
    ZERO_STAGE,
    Offload,
    Strategy,
)
from backend.spec.dims import MAX_WORLD
from backend.spec.section_base import SpecSection


class ParallelHead(SpecSection):
    """The fields of `ParallelSpec` before the dimensions' (backend/spec/dims.py)."""

    strategy: Strategy = Strategy.DDP
    """Headline strategy; mixes combine a data-parallel flavour (ddp..fsdp) with tp/pp/ep degrees."""
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Total ranks; None means dp * cp * tp * pp."""


ParallelDegrees = dims.spec_model(dims.DIMS, ParallelHead)
"""`ParallelHead` and every field of the dimension table: the degrees dp, tp, pp, ep, cp and their options
(sequence_parallel, pp_schedule, virtual_stages, cp_rotate, cp_load_balance), each with its bounds and docstring."""
_DEGREES = dims.degree_names(dims.DIMS)


class ParallelSpec(ParallelDegrees):
    offload: Offload = Offload.NONE
    """Host (CPU) offload: optimizer (DeepSpeed offload_optimizer) or params (params, grads and optimizer
    state: DeepSpeed offload_param + offload_optimizer, torch FSDP2 CPUOffloadPolicy for zero2/zero3)."""

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE.get(self.strategy, 0)

    def degrees(self) -> dict[str, int]:
        """{dimension: degree} (an underived dp counts as 1)."""
        return {d: getattr(self, d) or 1 for d in _DEGREES}

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank. The mesh is (pp, dp, cp, tp), row-major, tp fastest-varying (torchtitan's
        order); "cp" is present when cp > 1. Expert-parallel groups are consecutive blocks of ep ranks along the
        data-parallel index dp * cp + cp index (`data_parallel_index`). Laid out by backend/spec/dims.py."""
        return dims.coords(dims.DIMS, self.degrees(), rank)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters: dp x cp. Gradients are averaged over them and ZeRO / FSDP shards
        span them (torchtitan's dp_shard_cp, Megatron's data-parallel group with cp)."""
        return (self.dp or 1) * self.cp

    def data_parallel_index(self, rank: int) -> int:
        """The rank's index in its dp x cp group (dp index * cp + cp index): its FSDP shard and ZeRO-1 share."""
        return (rank // self.tp) % self.dp_cp

    def rank_at(self, **at: int) -> int:
        """The global rank at these mesh coordinates (rank_at(pp=0, dp=1, cp=0, tp=1); inverse of `coords`)."""
        return dims.rank_at(dims.DIMS, self.degrees(), at)

    @property
    def dp_flavour(self) -> Strategy:
        """The data-parallel wrapper used for the dp dimension (plain DDP for the pure tp/pp/ep strategies)."""
        return self.strategy if self.strategy in DP_FLAVOURS else Strategy.DDP

    @property
    def strategy_module(self) -> str:
        """The name a rank reports as its "strategy_module": the outermost model-parallel dimension of the mix, else
        the dp flavour (zero3 and fsdp are both "fsdp")."""
        if self.pp > 1:
            return "pp"
        if self.tp > 1:
            return "tp"
        if self.ep > 1:
            return "ep"
        return "fsdp" if self.dp_flavour in (Strategy.ZERO3, Strategy.FSDP) else str(self.dp_flavour)
