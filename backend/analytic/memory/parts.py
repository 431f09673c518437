"""A rank's parameters as sums over three parts: its transformer blocks, the embeddings, the head.

A pipeline rank holds `n_blocks` identical blocks, plus the embeddings when it holds the first stage and the final
norm and lm_head when it holds the last (and, tied, its own copy of the word embedding). Every parameter-dependent
memory term is a sum over the rank's local parameters, so it is n_blocks x (one block's sum) + first x (the
embeddings' sum) + last x (the head's sum); each part's sums come from sharding.shard_param (torch's placement)
at the rank's tp / dp / ep indices, once per distinct (degrees, indices). Works for one layout or arrays of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from backend.analytic.device import cuda_storage_bytes
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.params import (
    ModelKey,
    ParamInfo,
    block_param_list,
    layer_attention_kind,
    layer_is_moe,
    model_key,
    param_tuple,
)
from backend.analytic.scalar_or_array import (
    any_true,
    ceil_div,
    logical_and,
    maximum,
    minimum,
    per_distinct,
    take_rows,
    where,
)
from backend.analytic.sharding import (
    LocalParam,
    expert_of,
    layer_split,
    shard_param,
    shard_split,
    stages_of_rank,
    tp_style,
)
from backend.analytic.tp_placement import VOCAB_ROWWISE
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

PARTS = ("block", "embeddings", "head")
ALT_PART = "alt_block"
"""Mixed stacks (a dense prefix, interleaved MoE): the blocks whose MLP kind differs from block 0's."""


class PartSums(NamedTuple):
    """Sums over one part's local parameters (elements unless named bytes)."""
    tensors: Num
    local_numel: Num
    """After the tp / ep split (what DDP, ZeRO-1 and the autocast casts see)."""
    storage_numel: Num
    """This rank's storage (FSDP2: the padded dim-0 chunk)."""
    real_numel: Num
    """Elements this rank owns (FSDP2: unpadded rows)."""
    unsharded_grad_numel: Num
    """sharding.unsharded_grad_numel: the gradient of the unsharded (tp-local) parameter."""
    fsdp_unsharded_numel: Num
    """FSDP2-managed tensors all-gathered (group x padded shard); ep experts are ignored_params."""
    fsdp_unsharded_grad_numel: Num
    linear_weight_numel: Num
    """Blocks' 2-D (Linear) weights: autocast saves a 16-bit copy of each."""
    linear_bias_numel: Num
    """Blocks' Linear biases: autocast caches a 16-bit copy of each."""
    head_weight_numel: Num
    token_embedding_numel: Num
    cuda_local_bytes: Num
    """Sum of 512-B-rounded fp32 storages of local_numel (device.cuda_storage_bytes), likewise below."""
    cuda_storage_bytes: Num
    cuda_real_bytes: Num
    ep_expert_numel: Num
    """Routed experts' elements under ep > 1: outside FSDP2 / ZeRO (ignored_params), their grads all-reduced over the
    expert-replica group (traffic.dp_traffic, ep.sync_expert_grads)."""
    cuda_ep_expert_bytes: Num
    """Their 512-B-rounded fp32 storages (CUDA ranks)."""


@lru_cache(maxsize=256)
def part_params(key: ModelKey, part: str, tied_copy: bool) -> tuple[ParamInfo, ...]:
    """One part's full-size parameters (block 0 stands for every block of its MLP kind, the first block of the other
    kind for the alt_block part: within a kind shapes and placement are the same)."""
    if part == "block":
        return tuple(block_param_list(key, 0))
    if part == ALT_PART:
        alt = alt_layers(key)
        return tuple(block_param_list(key, alt[0])) if alt else ()
    rest = [q for q in param_tuple(key) if not q.name.startswith("layers.")]
    embeddings = [q for q in rest if q.name.split(".")[0] in ("tok_emb", "pos_emb")]
    if part == "embeddings":
        return tuple(embeddings)
    head = [q for q in rest if q not in embeddings]
    if tied_copy:  # sharding._pp_params: the last stage's own copy of the tied word embedding
        head.append(ParamInfo("lm_head.weight", (key.vocab_size, key.d_model)))
    return tuple(head)


@lru_cache(maxsize=8192)
def local_part(key: ModelKey, part: str, tied_copy: bool, placement: tuple[int, ...]) -> tuple[LocalParam, ...]:
    """One part's parameters on a rank. placement = (tp, dp, ep, fsdp, tp_index, dp_index, ep_index[, etp])."""
    tp, dp, ep, fsdp, tp_index, dp_index, ep_index, *etp = placement
    out = (shard_param(q, n_experts=key.n_experts, tp=tp, dp=dp, ep=ep, tp_rank=tp_index, dp_rank=dp_index,
                       ep_rank=ep_index, fsdp=bool(fsdp), etp=int(etp[0]) if etp else 1)
           for q in part_params(key, part, tied_copy))
    return tuple(q for q in out if q is not None)


class _ParamClass(NamedTuple):
    """Parameters of a part that shard_param places alike and part_sums counts alike (a MoE block's E experts' w1,
    ...): what shard_param reads of the name, part_sums' name flags, and the expert ids (empty: not an expert)."""
    shape: tuple[int, ...]
    style: str
    bias: bool
    flags: tuple[bool, bool, bool, bool]
    """(in a block, a block's Linear bias, lm_head's, tok_emb.weight)."""
    count: int
    experts: tuple[int, ...]


@lru_cache(maxsize=256)
def _param_classes(key: ModelKey, part: str, tied_copy: bool) -> tuple[_ParamClass, ...]:
    classes: dict[tuple, list[int]] = {}
    for q in part_params(key, part, tied_copy):
        name, expert = q.name, expert_of(q.name)
        block = name.startswith("layers.")
        flags = (block, block and name.endswith(".bias") and ".ln" not in name, name.startswith("lm_head."),
                 name == "tok_emb.weight")
        members = classes.setdefault((q.shape, tp_style(name), name.endswith(".bias"), flags, expert is not None), [])
        members.append(-1 if expert is None else expert)
    return tuple(_ParamClass(shape, style, bias, flags, len(ids), tuple(ids) if is_expert else ())
                 for (shape, style, bias, flags, is_expert), ids in classes.items())


@lru_cache(maxsize=8192)
def part_sums(key: ModelKey, part: str, tied_copy: bool, placement: tuple[int, ...], cuda: bool = True) -> PartSums:
    """One part's sums at a placement (cuda=False: the 512-B-rounded sums, read only for CUDA ranks, left 0): each
    class of alike parameters placed once (sharding.shard_param's rules) and counted as often as this rank holds it."""
    tp, dp, ep, fsdp, tp_index, dp_index, ep_index, *etp = placement
    etp = int(etp[0]) if etp else 1
    rounded = cuda_storage_bytes if cuda else _zero
    totals = [0] * len(PartSums._fields)
    for c in _param_classes(key, part, tied_copy):
        if c.experts and ep > 1:  # sharding.ep_keeps: this ep rank's n_experts / ep experts
            per = key.n_experts // ep
            kept = [e for e in c.experts if ep_index * per <= e < (ep_index + 1) * per]
        else:
            kept = c.experts or [None]
        count = len(kept) if c.experts else c.count
        if not count:
            continue
        local, storage, real, group, _, is_expert = shard_split(
            c.shape, c.style, c.bias, kept[0], n_experts=key.n_experts, tp=tp, dp=dp, ep=ep, tp_rank=tp_index,
            dp_rank=dp_index, ep_rank=ep_index, fsdp=bool(fsdp), etp=etp)
        local_numel = prod(local)
        # sharding.unsharded_grad_numel: DTensor's vocab-parallel embedding backward gives the full tensor
        ugrad = prod(c.shape) if tp > 1 and c.style == VOCAB_ROWWISE else local_numel
        managed = not (is_expert and ep > 1)
        block, block_bias, lm_head, tok_emb = c.flags
        row = (1, local_numel, storage, real, ugrad, storage * group if managed else 0, ugrad if managed else 0,
               local_numel if block and len(c.shape) == 2 else 0, local_numel if block_bias else 0,
               local_numel if lm_head else 0, local_numel if tok_emb else 0, rounded(MASTER_BYTES * local_numel),
               rounded(MASTER_BYTES * storage), rounded(MASTER_BYTES * real), 0 if managed else local_numel,
               0 if managed else rounded(MASTER_BYTES * local_numel))
        totals = [t + count * v for t, v in zip(totals, row, strict=False)]
    return PartSums(*totals)


def _zero(_: int) -> int:
    return 0


@lru_cache(maxsize=256)
def alt_layers(key: ModelKey) -> tuple[int, ...]:
    """The blocks whose MLP kind (dense / MoE) differs from block 0's; () for a uniform stack."""
    first = layer_is_moe(key, 0)
    return tuple(i for i in range(key.n_layers) if layer_is_moe(key, i) != first)


def is_mixed(model: ModelSpec) -> bool:
    return bool(alt_layers(model_key(model)))


@lru_cache(maxsize=4096)
def alt_composition(key: ModelKey, pp: int, virtual_stages: int, zbv: bool, pp_rank: int) -> tuple[int, int]:
    """(blocks of the alt kind, 1 if the rank's last block is one) on a pipeline rank (sharding.stages_of_rank)."""
    alt = set(alt_layers(key))
    split = layer_split(key.n_layers, pp * virtual_stages)
    layers = [i for st in stages_of_rank(pp_rank, pp, virtual_stages, "zbv" if zbv else "1f1b") for i in split[st]]
    return sum(i in alt for i in layers), int(bool(layers) and max(layers) in alt)


@lru_cache(maxsize=4096)
def attention_composition(kinds: tuple[tuple[bool, bool], ...], pp: int, virtual_stages: int, zbv: bool,
                          pp_rank: int) -> tuple[int, int]:
    """(rotary blocks, windowed blocks) on a pipeline rank; kinds = params.layer_attention_kind of every block."""
    split = layer_split(len(kinds), pp * virtual_stages)
    layers = [i for st in stages_of_rank(pp_rank, pp, virtual_stages, "zbv" if zbv else "1f1b") for i in split[st]]
    return sum(kinds[i][0] for i in layers), sum(kinds[i][1] for i in layers)


def attention_kind_counts(model: ModelSpec, layout: Layout, pp_rank: Num) -> tuple[Num, Num] | None:
    """(rotary blocks, windowed blocks) a rank holds when the model's blocks differ in attention kind (windows with
    global layers, NoPE layers); None when every block is like block 0."""
    kinds = tuple(layer_attention_kind(model, i) for i in range(model.n_layers))
    if len(set(kinds)) == 1:
        return None
    counts = per_distinct(lambda *row: attention_composition(kinds, *row), layout.pp, layout.virtual_stages,
                          layout.zbv, pp_rank)
    return counts if isinstance(counts, tuple) else (counts[..., 0], counts[..., 1])


@dataclass(frozen=True)
class StageComposition:
    """What a pipeline rank holds: blocks, and whether it holds the first / last stage (scalars or arrays)."""
    n_blocks: Num
    first: Num
    last: Num
    n_alt: Num = 0
    """Of n_blocks, those of the alt kind (mixed stacks; 0 otherwise)."""
    last_alt: Num = 0
    """The rank's last block is of the alt kind (the block FSDP2 holds unsharded inside the forward)."""
    n_lowest: Num = 0
    """Of n_blocks, those of the rank's lowest stage (stage pp_rank: the most when the split is uneven)."""

    def take(self, rows: np.ndarray, n: int) -> StageComposition:
        return StageComposition(*(take_rows(v, rows, n) for v in (self.n_blocks, self.first, self.last, self.n_alt,
                                                                   self.last_alt, self.n_lowest)))


def moe_blocks(model: ModelSpec, stages: StageComposition) -> Num:
    """The MoE blocks among a pipeline rank's blocks (0 for a dense model)."""
    if not model.is_moe:
        return 0
    return stages.n_alt if not layer_is_moe(model, 0) else stages.n_blocks - stages.n_alt


def stage_composition(model: ModelSpec, layout: Layout, pp_rank: Num) -> StageComposition:
    """sharding.stages_of_rank + layer_split in closed form: looped ranks hold stages r + k·pp (the first
    n_layers % n_stages stages get one more layer), ZBV rank r holds r and 2pp-1-r."""
    pp, v = layout.pp, layout.virtual_stages
    base, extra = model.n_layers // layout.n_stages, model.n_layers % layout.n_stages
    looped = v * base + minimum(v, maximum(0, ceil_div(extra - pp_rank, pp)))
    zbv = layout.zbv
    alt = {}
    if is_mixed(model):
        key = model_key(model)
        counts = per_distinct(lambda *row: alt_composition(key, *row), pp, v, zbv, pp_rank)
        alt = dict(n_alt=counts[0], last_alt=counts[1]) if isinstance(counts, tuple) else \
            dict(n_alt=counts[..., 0].astype(np.int64), last_alt=counts[..., 1].astype(np.int64))
    lowest = base + (pp_rank < extra)
    if not any_true(zbv):
        return StageComposition(n_blocks=looped, first=pp_rank == 0, last=pp_rank == pp - 1, n_lowest=lowest, **alt)
    v_shape = 2 * base + (pp_rank < extra) + (2 * pp - 1 - pp_rank < extra)
    return StageComposition(n_blocks=where(zbv, v_shape, looped), first=pp_rank == 0,
                            last=where(zbv, pp_rank == 0, pp_rank == pp - 1), n_lowest=lowest, **alt)


class RankParts:
    """A rank's composition and each part's sums at its placement: `sums` is a tuple of 3 x len(PartSums._fields)
    scalars, or one array whose last axis holds them (views per field, one index to restrict rows)."""

    def __init__(self, stages: StageComposition, sums: tuple[Num, ...] | np.ndarray, rows: int = 1):
        self.stages, self.sums, self.rows = stages, sums, rows
        self._totals: dict[str, Any] = {}

    def _part(self, j: int) -> PartSums:
        k = len(PartSums._fields)
        if isinstance(self.sums, tuple):
            return PartSums(*self.sums[j * k:(j + 1) * k])
        return PartSums(*(self.sums[..., j * k + i] for i in range(k)))

    @cached_property
    def block(self) -> PartSums:
        return self._part(0)

    @cached_property
    def embeddings(self) -> PartSums:
        return self._part(1)

    @cached_property
    def head(self) -> PartSums:
        return self._part(2)

    @cached_property
    def alt_block(self) -> PartSums:
        """The other MLP kind's block (mixed stacks; zeros otherwise)."""
        k = len(PartSums._fields)
        has = len(self.sums) > 3 * k if isinstance(self.sums, tuple) else self.sums.shape[-1] > 3 * k
        return self._part(3) if has else PartSums(*([0] * k))

    @cached_property
    def last_block(self) -> PartSums | _Chosen:
        """The rank's last block's sums (its kind: block or alt_block), PartSums' fields by name; on arrays each field
        is chosen when first read (the callers read a few of them)."""
        last_alt = self.stages.last_alt
        if not _nonzero(last_alt):
            return self.block
        return _Chosen(last_alt, self.alt_block, self.block)

    def take(self, rows: np.ndarray) -> RankParts:
        """The parts of the layouts at `rows` (scalar_or_array.per_value)."""
        return RankParts(self.stages.take(rows, self.rows), take_rows(self.sums, rows, self.rows), rows=len(rows))

    def total(self, name: str) -> Num:
        """The rank's sum of `name`: n_blocks x block + first x embeddings + last x head (parts whose sum is zero
        everywhere skipped: most fields live in one part only)."""
        hit = self._totals.get(name)
        if hit is None:
            s = self.stages
            terms = [(count, j) for j, count in enumerate((s.n_blocks - s.n_alt, s.first, s.last))]
            if self._has_alt:
                terms.append((s.n_alt, 3))
            parts = (self.block, self.embeddings, self.head, self.alt_block)
            hit = 0
            for count, j in terms:
                if self._live(j, name):
                    hit = hit + count * getattr(parts[j], name)
            self._totals[name] = hit
        return hit

    @cached_property
    def _has_alt(self) -> bool:
        return _nonzero(self.stages.n_alt)

    @cached_property
    def _live_columns(self) -> list[bool] | None:
        """Per column of an array `sums`: whether some row holds a nonzero (one pass over the contiguous array; a
        column read alone is a strided view). None for scalar sums."""
        if isinstance(self.sums, tuple):
            return None
        return (self.sums != 0).reshape(-1, self.sums.shape[-1]).any(axis=0).tolist()

    def _live(self, j: int, name: str) -> bool:
        """Whether part j's `name` is nonzero for some layout (total() skips it otherwise)."""
        live = self._live_columns
        if live is None:
            return _nonzero(getattr((self.block, self.embeddings, self.head, self.alt_block)[j], name))
        column = j * len(PartSums._fields) + PartSums._fields.index(name)
        return column < len(live) and live[column]


class _Chosen:
    """PartSums' fields read as where(condition, a.field, b.field), each computed on its first read."""

    def __init__(self, condition: Num, a: PartSums, b: PartSums):
        self._condition, self._a, self._b = condition, a, b

    def __getattr__(self, name: str) -> Any:
        if name not in PartSums._fields:
            raise AttributeError(name)
        value = where(self._condition, getattr(self._a, name), getattr(self._b, name))
        setattr(self, name, value)
        return value


def _nonzero(value: Any) -> bool:
    return bool(value.any()) if isinstance(value, np.ndarray) else bool(value)


def tied_copy(model: ModelSpec, layout: Layout) -> Num:
    """The last stage holds its own copy of a tied word embedding when the model is split into stages."""
    return logical_and(bool(getattr(model, "tie_embeddings", False)), layout.n_stages > 1)


def rank_parts(model: ModelSpec, layout: Layout, position: RankPosition, *, fsdp: Num | None = None) -> RankParts:
    """Part sums at the rank's placement; fsdp=False gives the tp / ep split only (ZeRO-1 and serving)."""
    key = model_key(model)
    own_flavour = fsdp is None
    fsdp = layout.fsdp if own_flavour else fsdp
    cuda = layout.device == "cuda"

    parts = PARTS + ((ALT_PART,) if alt_layers(key) else ())

    def three(tp, dp, ep, fs, tpi, dpi, epi, tied, etp):
        placement = (tp, dp, ep, fs, tpi, dpi, epi, etp)
        return sum((part_sums(key, part, bool(tied) and part == "head", placement, cuda) for part in parts), ())

    def compute() -> Any:
        return per_distinct(three, layout.tp, layout.dp_cp, layout.ep, fsdp, position.tp_index,
                            maximum(position.dp_index, 0), position.ep_index, tied_copy(model, layout), layout.etp)

    indices = (position.tp_index, position.dp_index, position.ep_index)
    if any(isinstance(i, np.ndarray) for i in indices) or isinstance(fsdp, np.ndarray) and not own_flavour:
        values = compute()
    else:
        values = layout.memoised(("part sums", key, indices, "layout" if own_flavour else bool(fsdp)), compute)
    return RankParts(stage_composition(model, layout, position.pp_rank), values, rows=len(layout))
