"""The temporaries inside optimizer.step of one rank (optimizer_state.step_temp_bytes over the rank's local optimizer
parameters, in its order), for one layout or arrays of them: `step_temp_bytes_of`. `estimate` and the planner read
the same numbers (the optimizer.step moment: the resting state, activations freed, the update's temporaries alive).

The local optimizer holds, per rank: every local parameter in the model's `named_parameters()` order (ddp, FSDP2 with
its unpadded shard, `replicate`), ZeRO-1's share of whole parameters (zero1_share.py), or the distributed optimizer's
per-bucket slices (dp_buckets.py: embeddings, each block, the head). Each distinct placement is evaluated once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic.device import CUDA
from backend.analytic.dp_buckets import padded
from backend.analytic.layout import Layout, RankPosition, ZeroStage
from backend.analytic.memory.model_state import zero1_optimizer_step
from backend.analytic.memory.parts import ALT_PART, RankParts, alt_layers, local_part, part_sums, tied_copy
from backend.analytic.optimizer_state import step_temp_bytes
from backend.analytic.params import ModelKey, model_key
from backend.analytic.scalar_or_array import logical_and, maximum, per_distinct, per_value, where
from backend.analytic.sharding import layer_split, stages_of_rank
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

_PLAIN, _ZERO1, _BUCKETS = range(3)


@lru_cache(maxsize=65536)
def _part_run(key: ModelKey, part: str, tied: bool, placement: tuple[int, ...], owned: bool) -> tuple[int, int, int]:
    """(first, last, largest prev + 2 x cur inside) of one part's elements in the optimizer's order (owned: FSDP2's
    unpadded shard, else the tp / ep-local tensor); (0, 0, 0) for an empty part."""
    elements = [q.real_numel if owned else q.local_numel for q in local_part(key, part, tied, placement)]
    if not elements:
        return 0, 0, 0
    inner = max((a + 2 * b for a, b in zip(elements, elements[1:], strict=False)), default=0)
    return elements[0], elements[-1], inner


@lru_cache(maxsize=8192)
def _block_kinds(key: ModelKey, pp: int, v: int, zbv: bool, pp_rank: int) -> tuple[bool, ...]:
    """Per block of a pipeline rank, in layer order: whether it is of the other MLP kind (parts.ALT_PART)."""
    alt = set(alt_layers(key))
    split = layer_split(key.n_layers, pp * v)
    layers = sorted(i for st in stages_of_rank(pp_rank, pp, v, "zbv" if zbv else "1f1b") for i in split[st])
    return tuple(i in alt for i in layers)


def _largest_pair(runs: list[tuple[int, int, int]]) -> int:
    """max(prev + 2 x cur) over the concatenated runs (the first element's prev is 0): inside each run and across
    each boundary."""
    best, prev_last = 0, 0
    for first, last, inner in runs:
        best = max(best, inner, prev_last + 2 * first)
        prev_last = last
    return best


@lru_cache(maxsize=65536)
def _plain_temp(key: ModelKey, pp_rank: int, pp: int, v: int, zbv: bool, first: bool, last: bool, tied: bool,
                placement: tuple[int, ...], optimizer: str) -> int:
    """Single-tensor AdamW's step_temp_bytes over the rank's local parameters in the model's order (embeddings,
    blocks by layer, head), from each part's run: a rank's blocks repeat one part (two for mixed stacks)."""
    owned = bool(placement[3])
    runs = {part: _part_run(key, part, tied and part == "head", placement, owned)
            for part in ("embeddings", "block", ALT_PART, "head")}
    sequence = [runs["embeddings"]] if first else []
    kinds = _block_kinds(key, pp, v, zbv, pp_rank)
    # consecutive equal blocks add one boundary pair of their own: two of a kind in a row stand for any longer run
    for i, alt in enumerate(kinds):
        if i >= 2 and kinds[i - 1] == alt and kinds[i - 2] == alt:
            continue
        sequence.append(runs[ALT_PART if alt else "block"])
    if last:
        sequence.append(runs["head"])
    sequence = [r for r in sequence if r != (0, 0, 0)]
    if optimizer != "adamw":
        return 0
    return MASTER_BYTES * _largest_pair(sequence)


@lru_cache(maxsize=65536)
def _bucket_temp(key: ModelKey, pp_rank: int, pp: int, v: int, zbv: bool, first: bool, last: bool, tied: bool,
                 placement: tuple[int, ...], dp: int, edp: int, optimizer: str, foreach: bool) -> int:
    """The distributed optimizer: one fp32 slice per bucket (its padded elements / dp), in bucket order (embeddings,
    each block, the head); under ep > 1 a block's routed experts follow it as a bucket of their own, sharded over
    edp = dp x cp / ep (dp_buckets.bucket_groups, distributed_optimizer.model_state_bytes)."""
    memo: dict[str, list[int]] = {}

    def shards(part: str) -> list[int]:  # the same for every block of a kind: once per part
        hit = memo.get(part)
        if hit is None:
            sums = part_sums(key, part, tied and part == "head", placement, False)
            experts = sums.ep_expert_numel
            hit = memo[part] = [padded(sums.local_numel - experts, dp) // dp, padded(experts, edp) // edp]
        return hit

    slices = (shards("embeddings") if first else []) + [n for alt in _block_kinds(key, pp, v, zbv, pp_rank)
                                                       for n in shards(ALT_PART if alt else "block")]
    slices = [n for n in slices + (shards("head") if last else []) if n]
    return step_temp_bytes(slices, optimizer, foreach=foreach)


def step_temp_bytes_of(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> Num:
    """optimizer.step's temporaries of a rank. ZeRO-1 with `position.largest_zero1_share` (the worst rank, whose
    optimizer bytes are the largest share's): the largest state + temporaries of any share minus that largest state,
    so that optimizer bytes + this is the fullest optimizer.step of any dp index."""
    key = model_key(model)
    foreach = layout.device == CUDA
    opt = str(layout.optimizer)
    zero1 = logical_and(layout.zero_stage == ZeroStage.ZERO1, layout.dp_cp > 1)
    kind = where(layout.distributed_optimizer, _BUCKETS, where(zero1, _ZERO1, _PLAIN))

    def temp(lay: Layout, pos: RankPosition, prt: RankParts, k: int) -> Num:
        if k == _ZERO1:
            return zero1_optimizer_step(model, lay, pos, prt)
        st, tied = prt.stages, tied_copy(model, lay)
        if k == _BUCKETS:
            return per_distinct(
                lambda pp_rank, pp, v, zbv, first, last, tie, tp, tp_i, ep, ep_i, dp, dp_cp: _bucket_temp(
                key, pp_rank, pp, v, bool(zbv), bool(first), bool(last), bool(tie), (tp, 1, ep, 0, tp_i, 0, ep_i), dp,
                dp_cp // ep, opt, foreach), pos.pp_rank, lay.pp, lay.virtual_stages, lay.zbv, st.first, st.last, tied,
                lay.tp, pos.tp_index, lay.ep, pos.ep_index, lay.dp, lay.dp_cp)
        if foreach:  # _foreach_sqrt of every exp_avg_sq: the owned elements
            return MASTER_BYTES * prt.total("real_numel") if opt == "adamw" else 0
        return per_distinct(lambda pp_rank, pp, v, zbv, first, last, tie, *placement: _plain_temp(
            key, pp_rank, pp, v, bool(zbv), bool(first), bool(last), bool(tie), placement, opt),
            pos.pp_rank, lay.pp, lay.virtual_stages, lay.zbv, st.first, st.last, tied, lay.tp, lay.dp_cp, lay.ep,
            lay.fsdp, pos.tp_index, maximum(pos.dp_index, 0), pos.ep_index)

    return per_value(kind, temp, layout, position, parts)
