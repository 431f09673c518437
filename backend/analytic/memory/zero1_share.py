"""ZeRO-1's optimizer share per dp index (torch ZeroRedundancyOptimizer._partition_parameters, sharding.
zero1_partition): whole tp-local parameters, largest first, each to the dp rank with the smallest running total.

The shares depend only on the multiset of the rank's parameter sizes (equal sizes are interchangeable), so a
rank's list is built from its parts (blocks x n, embeddings, head) and partitioned once per distinct
(placement, composition, dp). `Zero1Shares` answers per dp index without materialising dp lists: a dp of a
million holds at most one share per parameter tensor, the rest are empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.device import CUDA
from backend.analytic.memory.parts import ALT_PART, RankParts, local_part
from backend.analytic.optimizer_state import state_bytes, state_bytes_from_sums, step_temp_bytes
from backend.analytic.params import ModelKey
from backend.analytic.sharding import zero1_owners_in_order

if TYPE_CHECKING:
    from backend.analytic.layout import Layout, RankPosition
    from backend.analytic.scalar_or_array import Num


@dataclass(frozen=True)
class Zero1Shares:
    """One partition: the rank's tensor sizes (largest first) and the dp index owning each."""
    dp: int
    numels: tuple[int, ...]
    owner: tuple[int, ...]

    @cached_property
    def shares(self) -> dict[int, tuple[int, ...]]:
        """{dp index: elements per owned tensor, largest first} of the non-empty shares."""
        out: dict[int, list[int]] = {}
        for n, k in zip(self.numels, self.owner, strict=False):
            out.setdefault(k, []).append(n)
        return {k: tuple(v) for k, v in out.items()}

    def share(self, dp_index: int) -> tuple[int, ...]:
        return self.shares.get(dp_index, ())

    def bytes(self, dp_index: int, optimizer: str, device: str) -> tuple[int, int]:
        """(optimizer state bytes, optimizer.step temporaries) of dp_index's share."""
        elements = self.share(dp_index)
        return (state_bytes(elements, optimizer, device),
                step_temp_bytes(elements, optimizer, foreach=device == CUDA))

    def largest(self, optimizer: str, device: str) -> int:
        """The largest share's optimizer state bytes (the worst dp index)."""
        if not self.numels:
            return 0
        if device == CUDA:
            return max(state_bytes(e, optimizer, device) for e in self.shares.values())
        owner = np.asarray(self.owner)  # every owner < len(numels) (sharding.zero1_partition): short bincounts
        elements = np.bincount(owner, weights=np.asarray(self.numels, dtype=np.float64))  # < 2^53: exact
        tensors = np.bincount(owner).astype(np.float64)
        held = tensors > 0
        return int(state_bytes_from_sums(elements=elements[held], tensors=tensors[held], cuda_bytes=0,
                                         optimizer=optimizer, device=device).max())

    def step_over_largest(self, optimizer: str, device: str) -> int:
        """The largest (state + optimizer.step temporaries) of any share minus the largest state: what the worst rank's
        optimizer.step moment adds to its (largest-share) optimizer bytes."""
        if not self.numels:
            return 0
        return max(sum(self.bytes(index, optimizer, device)) for index in self.shares) - self.largest(optimizer, device)

    def groups(self, optimizer: str, device: str) -> dict[tuple[int, int], list[int]]:
        """{(state bytes, temporaries): the non-empty dp indices with those}; every other dp index owns nothing."""
        out: dict[tuple[int, int], list[int]] = {}
        for index in sorted(self.shares):
            out.setdefault(self.bytes(index, optimizer, device), []).append(index)
        return out


@lru_cache(maxsize=8192)
def zero1_shares(key: ModelKey, placement: tuple[int, ...], n_blocks: int, first: bool, last: bool, tied_copy: bool,
                 dp: int, n_alt: int = 0) -> Zero1Shares:
    """The partition of a rank holding n_blocks blocks (n_alt of them of the other MLP kind; + embeddings, + head) at
    `placement` (parts.local_part)."""
    tp, _, ep, _, tp_index, _, ep_index, *etp = placement
    local = (tp, 1, ep, 0, tp_index, 0, ep_index, *etp)  # tp / ep-local sizes: the dp degree changes none of them
    counts: dict[int, int] = {}
    for part, times in (("embeddings", int(first)), ("block", n_blocks - n_alt), ("head", int(last)),
                        (ALT_PART, n_alt)):
        if not times:
            continue
        for size, n in _size_counts(key, part, tied_copy and part == "head", local).items():
            counts[size] = counts.get(size, 0) + n * times
    numels = [size for size in sorted(counts, reverse=True) for _ in range(counts[size])]  # largest first
    return Zero1Shares(dp, tuple(numels), tuple(zero1_owners_in_order(numels, dp)))


@lru_cache(maxsize=4096)
def _size_counts(key: ModelKey, part: str, tied_copy: bool, placement: tuple[int, ...]) -> dict[int, int]:
    """{local elements: tensors of that size} of one part (a block has a handful of distinct sizes)."""
    counts: dict[int, int] = {}
    for q in local_part(key, part, tied_copy, placement):
        counts[q.local_numel] = counts.get(q.local_numel, 0) + 1
    return counts


def zero1_share_args(model_key: ModelKey, layout: Layout, parts: RankParts, position: RankPosition, tied: Num) -> tuple:
    """The zero1_shares arguments of a scalar rank."""
    placement = (int(layout.tp), int(layout.dp_cp), int(layout.ep), 0, int(position.tp_index), 0,
                 int(position.ep_index), int(layout.etp))
    s = parts.stages
    return (model_key, placement, int(s.n_blocks), bool(s.first), bool(s.last), bool(tied), int(layout.dp_cp),
            int(s.n_alt))
