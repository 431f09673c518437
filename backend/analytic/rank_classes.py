"""Classes of equivalent ranks: ranks whose predicted memory and traffic are identical (up to their rank number and
mesh coordinates), so that a prediction is computed once per class and expanded per rank only for display.

A rank's prediction depends on its pipeline rank (which stages), its ep index (which experts), and its tp / FSDP dp
indices only through the torch.chunk sizes they get: `torch.chunk(x, n)` gives every index ceil(d/n) rows up to
d // ceil(d/n), then one shorter chunk, then empty ones. Over the dims of every parameter that makes a handful of
index intervals with equal sizes (`chunk_intervals`), whatever n is: a million dp ranks form a few classes.
ZeRO-1 gives each dp index its own optimizer share; the classes keep one partition and answer per dp index.
Mesh order is (pp, dp, cp, tp), tp fastest; "dp" below is the index in the dp x cp group (every rank with the same
parameters: FSDP shards and ZeRO-1 shares run over it); ep groups are consecutive along it (ParallelSpec.coords).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING

from backend.analytic.params import param_list

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec, ParallelSpec


def chunk_intervals(dims: set[int], n: int) -> list[int]:
    """Sorted starts of the index intervals of [0, n) inside which `torch.chunk(x, n)` gives equal chunk sizes on
    every dim in `dims` (the first start is 0)."""
    starts = {0}
    for d in dims:
        if d <= 0:
            continue
        rows = ceil(d / n)
        for boundary in (d // rows, -(-d // rows)):  # first short chunk, first empty chunk
            if 0 < boundary < n:
                starts.add(boundary)
    return sorted(starts)


def _local_dims(dims: set[int], tp: int) -> set[int]:
    """Dims after the tp split: full, the ceil chunk and the tail chunk of each."""
    out = set(dims)
    for d in dims:
        rows = -(-d // tp) if d else 0
        out |= {rows, d - (d // rows) * rows if rows else 0}
    return out


@dataclass(frozen=True)
class RankClass:
    """Ranks with one pipeline rank, one ep index, and tp / dp indices inside one interval each."""
    pp_rank: int
    tp_indices: range
    dp_indices: range
    ep_index: int
    ep: int

    def dp_members(self) -> Iterator[int]:
        """The class's dp indices (those of its interval with dp % ep == ep_index)."""
        first = self.dp_indices.start + (self.ep_index - self.dp_indices.start) % self.ep
        return iter(range(first, self.dp_indices.stop, self.ep))

    @property
    def dp_count(self) -> int:
        first = self.dp_indices.start + (self.ep_index - self.dp_indices.start) % self.ep
        return max(0, -(-(self.dp_indices.stop - first) // self.ep))

    @property
    def ranks(self) -> int:
        return self.dp_count * len(self.tp_indices)

    def representative(self, parallel: ParallelSpec) -> int:
        """The class's lowest rank."""
        dp = next(self.dp_members())
        return (self.pp_rank * parallel.dp_cp + dp) * parallel.tp + self.tp_indices.start


@dataclass(frozen=True)
class RankClasses:
    """Every class of a spec's ranks and the lookup rank -> class."""
    parallel: ParallelSpec
    tp_starts: list[int]
    dp_starts: list[int]
    classes: dict[tuple[int, int, int, int], RankClass]

    def key(self, rank: int) -> tuple[int, int, int, int]:
        c = self.parallel.coords(rank)
        dp = self.parallel.data_parallel_index(rank)
        return (c["pp"], bisect_right(self.tp_starts, c["tp"]) - 1, bisect_right(self.dp_starts, dp) - 1, c["ep"])

    def of(self, rank: int) -> RankClass:
        return self.classes[self.key(rank)]


def rank_classes(spec: ExperimentSpec) -> RankClasses:
    """The classes of a validated spec's ranks: tp intervals over every parameter dim; FSDP dp intervals over the
    dims after the tp split (other flavours replicate or partition whole tensors: one dp interval)."""
    p = spec.parallel
    dims = {d for q in param_list(spec.model) for d in q.shape}
    tp_starts = chunk_intervals(dims, p.tp)
    dp_starts = chunk_intervals(_local_dims(dims, p.tp), p.dp_cp) if p.zero_stage >= 2 else [0]
    tp_ranges = [range(a, b) for a, b in zip(tp_starts, tp_starts[1:] + [p.tp], strict=False)]
    dp_ranges = [range(a, b) for a, b in zip(dp_starts, dp_starts[1:] + [p.dp_cp], strict=False)]
    classes = {}
    for pp_rank in range(p.pp):
        for i, tp_range in enumerate(tp_ranges):
            for j, dp_range in enumerate(dp_ranges):
                for ep_index in range(p.ep):
                    c = RankClass(pp_rank, tp_range, dp_range, ep_index, p.ep)
                    if c.dp_count:
                        classes[(pp_rank, i, j, ep_index)] = c
    return RankClasses(p, tp_starts, dp_starts, classes)
