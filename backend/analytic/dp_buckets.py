"""The distributed optimizer's buckets (backend/strategies/distributed_optimizer.py): which bucket a parameter
belongs to and each bucket's padded size, shared by the engine, the memory model (analytic/distributed_optimizer.py)
and the traffic model (traffic.py). Pure Python; `padded` takes arrays too."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.scalar_or_array import ceil_div
from backend.spec.stack_rules import megatron_distributed_optimizer

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.analytic.sharding import LocalParam
    from backend.spec import ExperimentSpec

EMBEDDINGS = ("tok_emb", "pos_emb")


@lru_cache(maxsize=1 << 17)  # a name's bucket is asked for once per rank and layout that holds it
def bucket_of(name: str) -> tuple[int, str]:
    """(order, bucket) of a parameter name: embeddings first, blocks in layer order, then the head."""
    top = name.split(".")[0]
    if top in EMBEDDINGS:
        return (-1, "embeddings")
    if top == "layers":
        index = name.split(".")[1]
        return (int(index), f"layers.{index}")
    return (1 << 30, "head")


def used_by(spec: ExperimentSpec) -> bool:
    """A validated spec runs the distributed optimizer (Layout.distributed_optimizer for one spec): zero1 x tp / pp / ep
    here, and every zero1 of the megatron stack (spec/stacks.megatron_distributed_optimizer)."""
    p = spec.parallel
    return p.zero_stage == 1 and (p.tp > 1 or p.pp > 1 or p.ep > 1 or megatron_distributed_optimizer(spec))


def padded(numel: Num, dp: Num) -> Num:
    """A bucket's elements rounded up to a multiple of dp (every dp rank owns an equal contiguous slice)."""
    if isinstance(numel, np.ndarray) and numel.dtype.kind == "f":
        # element counts held as floats (the planner's part sums): integer-valued and < 2^53, so the rounded quotient's
        # ceil is the exact one (ceil_div's value) without the float floor division, the slowest op of the bucket sums
        return np.ceil(numel / dp) * dp
    return ceil_div(numel, dp) * dp


def bucket_numels(params: Sequence[LocalParam], dp: int, edp: int | None = None) -> list[int]:
    """Padded elements per bucket of a rank's local parameters (LocalParam: name, local_numel, is_expert), bucket
    order. edp (ep > 1): an ep rank's experts of a block are a bucket of their own, padded to a multiple of edp
    (`expert_buckets` lists them apart)."""
    return [n for n, _ in bucket_groups(params, dp, edp)]


def bucket_groups(params: Sequence[LocalParam], dp: int, edp: int | None = None) -> list[tuple[int, int]]:
    """(padded elements, the group it shards over: dp, or edp for an expert bucket) per bucket, bucket order."""
    sizes: dict[tuple[float, str], int] = {}
    for q in params:
        order, name = bucket_of(q.name)
        key = (order + 0.5, f"{name}.experts") if edp is not None and q.is_expert else (order, name)
        sizes[key] = sizes.get(key, 0) + q.local_numel
    out = []
    for k in sorted(sizes):
        group = edp if k[1].endswith(".experts") else dp
        out.append((padded(sizes[k], group), group))
    return out
