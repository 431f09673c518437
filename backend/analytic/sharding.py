"""Which parameter elements live on which rank, as torch's own parallel APIs place them (pure Python).

Composition order for a mix: pipeline stage (which parameters) -> tensor/expert split (which slice)
-> data-parallel flavour (ZeRO-1 partition or FSDP2 shard of the local tensors). Each step mirrors
the torch source it models (torch 2.13):
- ZeRO-1: `ZeroRedundancyOptimizer._partition_parameters` (whole params, greedy, largest first).
- FSDP2: `_fsdp_param.FSDPParam._init_sharding_spec` + `_chunk_with_empty` (dim-0 chunks of
  ceil(d0/N) rows; every rank stores the padded chunk; TP DTensors are chunked on their local tensor).
- TP: DTensor `Shard(d)` = `torch.chunk` semantics on dim d (ceil split, last ranks smaller).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import ceil, prod
from typing import TYPE_CHECKING, Any

import numpy as np

from backend.analytic.params import ModelKey, ParamInfo, model_key, param_tuple
from backend.analytic.tp_placement import REPLICATE, ROWWISE, VOCAB_ROWWISE, module_placement

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec, ModelSpec

# The TP split of every module comes from THE placement table (tp_placement.py), which strategies/tp.py builds its
# DTensor plan from too.
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    name: str
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    local_shape: tuple[int, ...]
    """After the TP split: the tensor this rank's data-parallel wrapper sees."""
    storage_numel: int
    """Elements of this rank's parameter storage (FSDP2: the padded dim-0 chunk)."""
    real_numel: int
    """Elements this rank actually owns (FSDP2: unpadded rows; ZeRO-1: all local, see `zero1_owner`)."""
    dp_group: int
    """Size of the data-parallel group that replicates / shards this tensor."""
    dp_index: int
    """This rank's index in that group."""
    is_expert: bool = False

    @property
    def local_numel(self) -> int:
        return prod(self.local_shape)


def chunk_rows(d0: int, n: int, r: int) -> tuple[int, int]:
    """(padded rows, real rows) of chunk r of `torch.chunk(x, n, dim)` as FSDP2's `_chunk_with_empty` pads it."""
    rows = ceil(d0 / n) if d0 else 0  # torch.chunk: every chunk has ceil(d0/n) rows except the tail
    return rows, max(0, min(rows, d0 - r * rows))


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layers per pipeline stage; when uneven, the earlier stages get one extra layer."""
    return list(_layer_split(n_layers, n_stages))


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """layer_split(n_layers, n_stages)[stage] without copying the split."""
    return _layer_split(n_layers, n_stages)[stage]


@lru_cache(maxsize=1024)
def _layer_split(n_layers: int, n_stages: int) -> tuple[range, ...]:
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices held by pipeline rank `pp_rank`.

    Looped/interleaved (Narayanan et al. 2021, Sec 2.2): rank r holds r, r+p, r+2p, ...
    ZBV (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec 6 V-shape) and DualPipeV: rank r holds r and 2p-1-r.
    """
    if str(schedule) in ("zbv", "dualpipev") and pp > 1:  # the schedule is ignored without pipelining
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def rank_stages(spec: ExperimentSpec, rank: int) -> list[int]:
    """Pipeline stage indices a global rank holds (its pp coordinate under the spec's schedule)."""
    p = spec.parallel
    return sorted(stages_of_rank(p.coords(rank)["pp"], p.pp, p.virtual_stages, str(p.pp_schedule)))


def rank_layers(spec: ExperimentSpec, stages: list[int]) -> list[int]:
    """Transformer block indices of those stages."""
    split = layer_split(spec.model.n_layers, spec.parallel.pp * spec.parallel.virtual_stages)
    return sorted(i for s in stages for i in split[s])


def stage_modules(m: ModelKey, stage: int, n_stages: int) -> tuple[range, bool, bool]:
    """(layers, has embeddings, has final norm + lm_head) of one stage."""
    return layer_split(m.n_layers, n_stages)[stage], stage == 0, stage == n_stages - 1


def pp_param_list(m: ModelSpec, pp_rank: int, pp: int, virtual_stages: int = 1,
                  schedule: str = "1f1b") -> list[ParamInfo]:
    """Parameters on pipeline rank `pp_rank`, in the full model's `named_parameters()` order."""
    return list(_pp_params(model_key(m), pp_rank, pp, virtual_stages, str(schedule)))


@lru_cache(maxsize=4096)
def _pp_params(key: ModelKey, pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> tuple[ParamInfo, ...]:
    n_stages = pp * virtual_stages
    layers: set[int] = set()
    first = last = False
    for s in stages_of_rank(pp_rank, pp, virtual_stages, schedule):
        rng, f, la = stage_modules(key, s, n_stages)
        layers.update(rng)
        first, last = first or f, last or la
    keep = [p for p, (kind, layer) in zip(param_tuple(key), _param_places(key), strict=False)
            if (layer in layers if kind == 0 else first if kind == 1 else last)]
    if key.tie_embeddings and last and n_stages > 1:
        # Tied embeddings across pipeline stages (Shoeybi et al. 2019 / Megatron-LM `shared_embedding`): the
        # last stage holds its own copy of the (V, h) word embedding as lm_head.weight; the two copies'
        # gradients are all-reduced between the first and last stage every step so they stay identical. A rank
        # holding both (ZBV's V shape) builds them as two stage modules: two copies there too, summed locally.
        keep.append(ParamInfo("lm_head.weight", (key.vocab_size, key.d_model)))
    return tuple(keep)


@lru_cache(maxsize=64)
def _param_places(key: ModelKey) -> tuple[tuple[int, int], ...]:
    """Per parameter of param_tuple(key): (0, layer) for a transformer block's, (1, -1) for the embeddings (first
    stage), (2, -1) for the rest (last stage); parsed once per model, not once per pipeline rank."""
    out = []
    block, prefix = (0, -1), "\0"
    for p in param_tuple(key):
        if p.name.startswith(prefix):  # the block of the parameter before (blocks are contiguous)
            out.append(block)
            continue
        parts = p.name.split(".")
        top = parts[0]
        if top == "layers":
            block, prefix = (0, int(parts[1])), f"layers.{parts[1]}."
            out.append(block)
        else:
            out.append((1, -1) if top in ("tok_emb", "pos_emb") else (2, -1))
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def tp_style(name: str) -> str:
    """TP placement of a parameter (by its module's rule in tp_placement.TP_PLACEMENT, whose patterns take any layer
    and expert id: each distinct module is matched once with its ids set to 0)."""
    return module_placement(_IDS.sub("0", name.rsplit(".", 1)[0]))


_IDS = re.compile(r"(?<=^layers\.)\d+|(?<=\.experts\.)\d+")


def tp_local_shape(p: ParamInfo, tp: int, tp_rank: int) -> tuple[int, ...]:
    """Local DTensor shape under the TP plan (Shard(d) uses torch.chunk sizes: ceil, last ranks smaller)."""
    if tp == 1:
        return p.shape
    return _tp_local(p.shape, tp_style(p.name), p.name.endswith(".bias"), tp, tp_rank)


def _tp_local(shape: tuple[int, ...], style: str, bias: bool, tp: int, tp_rank: int) -> tuple[int, ...]:
    if tp == 1 or style == REPLICATE or (style == ROWWISE and bias):
        return shape
    # Linear colwise and Embedding rowwise shard dim 0 (rows); Linear rowwise shards dim 1 (in-features)
    dim = 1 if style == ROWWISE else 0
    _, real = chunk_rows(shape[dim], tp, tp_rank)
    return shape[:dim] + (real,) + shape[dim + 1:]


@lru_cache(maxsize=1 << 16)
def expert_of(name: str) -> int | None:
    hit = _EXPERT.match(name)
    return int(hit.group(2)) if hit else None


def ep_keeps(name: str, n_experts: int, ep: int, ep_rank: int) -> bool:
    """Expert parallelism (Lepikhin et al. 2020, GShard Sec 2.2): experts split evenly, the rest replicated."""
    return _ep_keeps(expert_of(name), n_experts, ep, ep_rank)


def _ep_keeps(e: int | None, n_experts: int, ep: int, ep_rank: int) -> bool:
    if e is None or ep == 1:
        return True
    per = n_experts // ep
    return ep_rank * per <= e < (ep_rank + 1) * per


def zero1_partition(numels: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: torch ZeroRedundancyOptimizer._partition_parameters (one param group).
    Stable sort by numel descending, then `zero1_owners_in_order`."""
    order = sorted(range(len(numels)), key=numels.__getitem__, reverse=True)
    owner = [0] * len(numels)
    for i, r in zip(order, zero1_owners_in_order([numels[i] for i in order], n), strict=False):
        owner[i] = r
    return owner


def zero1_owners_in_order(numels_desc: list[int], n: int) -> list[int]:
    """Owner rank of each parameter of a list already in the partition's order (largest first): each to the rank
    with the smallest running total (first on ties); a heap of (running total, rank) gives that same minimum in
    O(log n). Ranks beyond len(numels) are never the smallest popped, so every owner is < len(numels).

    A run of k equal sizes x (a MoE block's experts) goes round the ranks in (total, rank) order, k // n whole rounds
    then the first k % n, once every rank's (total + x, rank) sorts after every other's (total, rank): each pick then
    lands behind all the others, so the heap would pop them in that order too (checked every n pops)."""
    count = len(numels_desc)
    if n >= count and (not numels_desc or numels_desc[-1] > 0):  # every rank still empty at its turn
        return list(range(count))
    heap = [(0, k) for k in range(min(n, count))]
    ranks = len(heap)
    owner = [0] * count
    i = 0
    while i < count:
        x = numels_desc[i]
        end = i
        while end < count and numels_desc[end] == x:
            end += 1
        since_check = ranks
        while i < end:
            if x > 0 and end - i >= ranks and since_check >= ranks:
                since_check = 0
                ordered = sorted(heap)
                if all((t + x, r) > ordered[-1] for t, r in ordered[:-1]):
                    rounds, rest = divmod(end - i, ranks)
                    order = [r for _, r in ordered]
                    owner[i:end] = order * rounds + order[:rest]
                    heap = [(t + (rounds + (k < rest)) * x, r) for k, (t, r) in enumerate(ordered)]
                    heapq.heapify(heap)
                    i = end
                    break
            if x > 0 and end - i >= _MERGE_RUN:
                owner[i:end], heap = _merge_run(heap, x, end - i)
                i = end
                break
            size, r = heapq.heappop(heap)
            owner[i] = r
            heapq.heappush(heap, (size + x, r))
            i += 1
            since_check += 1
    return owner


_MERGE_RUN = 256
"""Runs of equal sizes at least this long are placed by _merge_run (numpy) instead of one heap pop each."""


def _merge_run(heap: list[tuple[int, int]], x: int, k: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The owners of k parameters of size x > 0 and the heap after them. The heap pops the k smallest keys of the
    merged sequences (total + j·x, rank), j >= 0, one per rank (each rank's next key enters as its last leaves):
    count each rank's keys up to the smallest bound that holds k of them, sort those, keep the first k."""
    totals = np.array([t for t, _ in heap], dtype=np.int64)
    ranks = np.array([r for _, r in heap], dtype=np.int64)
    lo, hi = int(totals.min()), int(totals.max()) + (k // len(heap) + 1) * x

    def held(bound: int) -> np.ndarray:
        return np.where(totals <= bound, (bound - totals) // x + 1, 0)

    while lo < hi:  # the smallest bound with at least k keys <= it
        mid = (lo + hi) // 2
        if int(held(mid).sum()) >= k:
            hi = mid
        else:
            lo = mid + 1
    counts = held(lo)
    who = np.repeat(np.arange(len(heap)), counts)
    step = np.arange(len(who)) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = totals[who] + step * x
    first = who[np.lexsort((ranks[who], keys))[:k]]
    taken = np.bincount(first, minlength=len(heap))
    after = [(int(t), int(r)) for t, r in zip(totals + taken * x, ranks, strict=False)]
    heapq.heapify(after)
    return ranks[first].tolist(), after


def local_params(spec: ExperimentSpec, rank: int, *, dp_shard: bool = True) -> list[LocalParam]:
    """This rank's parameters after pp -> tp/ep -> data-parallel flavour sharding (dp_shard=False stops at tp/ep); the
    data-parallel group is dp x cp (every rank with the same parameters). Built run by run (the embeddings, each
    block, the head: _place_runs), each run's split taken from the first run of the same shapes and placement rules
    (_run_splits): a MoE block's hundreds of expert tensors are placed once per placement, not once per layer."""
    m, p = spec.model, spec.parallel
    c = p.coords(rank)
    key = model_key(m)
    placement = (key.n_experts, p.tp, p.dp_cp, p.ep, c["tp"], p.data_parallel_index(rank), c["ep"],
                 dp_shard and p.zero_stage >= 2, p.etp)
    out: list[LocalParam] = []
    for run, signature in _rank_runs(key, c["pp"], p.pp, p.virtual_stages, str(p.pp_schedule)):
        out += _local_run(run, signature, placement)
    return out


_RUN_LOCALS: dict[tuple, tuple[tuple[ParamInfo, ...], tuple[LocalParam, ...]]] = {}
_RUN_LOCALS_MAX = 1 << 19
"""LocalParams the run memo holds at most (~80 MB; a DeepSeek-V3 rank of ep 1 holds 47k)."""
_run_locals_held = [0]


def _local_run(run: tuple[ParamInfo, ...], signature: int, placement: tuple) -> tuple[LocalParam, ...]:
    """A run's LocalParams at a placement, shared by every rank and layout that holds the run there (the runs are
    cached tuples: memoised on the object, which the entry keeps alive)."""
    hit = _RUN_LOCALS.get((id(run), placement))
    if hit is None or hit[0] is not run:
        if _run_locals_held[0] + len(run) > _RUN_LOCALS_MAX:
            _RUN_LOCALS.clear()
            _run_locals_held[0] = 0
        _run_locals_held[0] += len(run)
        hit = _RUN_LOCALS[(id(run), placement)] = (run, tuple(
            LocalParam(run[i].name, run[i].shape, *split) for i, split in _run_kept(signature, placement)))
    return hit[1]


@lru_cache(maxsize=64)
def _place_runs(key: ModelKey) -> tuple[tuple[int, int, tuple[ParamInfo, ...], int], ...]:
    """param_tuple(key) cut into runs of one place each (sharding._param_places: (0, layer) a block's, (1, -1) the
    embeddings, (2, -1) the rest), in order, each with its signature id (_signature_id)."""
    runs: list[tuple[int, int, list[ParamInfo]]] = []
    for info, place in zip(param_tuple(key), _param_places(key), strict=False):
        if not runs or runs[-1][:2] != place:
            runs.append((*place, []))
        runs[-1][2].append(info)
    templates: dict[tuple, int] = {}  # a block's parameters past its "layers.<i>." prefix, and shapes -> signature id
    out = []
    for kind, layer, params in runs:
        if kind == 0:
            cut = len(f"layers.{layer}.")
            form = tuple((q.name[cut:], q.shape) for q in params)
            if form not in templates:  # tp_style / expert_of read nothing else of a block parameter's name
                templates[form] = _signature_id(params)
            out.append((kind, layer, tuple(params), templates[form]))
        else:
            out.append((kind, layer, tuple(params), _signature_id(params)))
    return tuple(out)


@lru_cache(maxsize=4096)
def _rank_runs(key: ModelKey, pp_rank: int, pp: int, virtual_stages: int,
               schedule: str) -> tuple[tuple[tuple[ParamInfo, ...], int], ...]:
    """The runs of _pp_params with their signature ids (the same parameters, in the same order; a tied copy of the
    word embedding its own run)."""
    n_stages = pp * virtual_stages
    layers: set[int] = set()
    first = last = False
    for s in stages_of_rank(pp_rank, pp, virtual_stages, schedule):
        rng, f, la = stage_modules(key, s, n_stages)
        layers.update(rng)
        first, last = first or f, last or la
    runs = tuple((params, signature) for kind, layer, params, signature in _place_runs(key)
                 if (layer in layers if kind == 0 else first if kind == 1 else last))
    if key.tie_embeddings and last and n_stages > 1:
        copy = (ParamInfo("lm_head.weight", (key.vocab_size, key.d_model)),)
        runs += ((copy, _signature_id(copy)),)
    return runs


_SIGNATURE_IDS: dict[tuple, int] = {}
_SIGNATURE_OF: list[tuple] = []


def _signature_id(run: Sequence[ParamInfo]) -> int:
    """What shard_param reads of each parameter of a run (shape, tp style, bias or not, expert index), as a small id:
    runs that read the same share their splits (_run_splits)."""
    signature = tuple((q.shape, tp_style(q.name), q.name.endswith(".bias"), expert_of(q.name)) for q in run)
    if signature not in _SIGNATURE_IDS:
        _SIGNATURE_IDS[signature] = len(_SIGNATURE_OF)
        _SIGNATURE_OF.append(signature)
    return _SIGNATURE_IDS[signature]


@lru_cache(maxsize=4096)
def _run_splits(signature: int, placement: tuple) -> tuple[tuple | None, ...]:
    """shard_param's split (None: another ep rank's expert) of each parameter of a run with this signature."""
    n_experts, tp, dp, ep, tp_rank, dp_rank, ep_rank, fsdp, etp = placement
    return tuple(shard_split(*read, n_experts=n_experts, tp=tp, dp=dp, ep=ep, tp_rank=tp_rank, dp_rank=dp_rank,
                              ep_rank=ep_rank, fsdp=fsdp, etp=etp) for read in _SIGNATURE_OF[signature])


@lru_cache(maxsize=4096)
def _run_kept(signature: int, placement: tuple) -> tuple[tuple[int, tuple], ...]:
    """(index in the run, split) of the parameters this placement keeps (_run_splits without the None: a MoE block's
    run holds every expert, an ep rank keeps n_experts / ep of them)."""
    return tuple((i, split) for i, split in enumerate(_run_splits(signature, placement)) if split is not None)


_LOCAL_MEMO: dict[tuple, tuple[LocalParam, ...]] = {}
_DERIVED: dict[tuple, tuple[Any, Any]] = {}
_MEMO_MAX = 512  # rank lists: a 30-layout pool of a 70B model holds ~500 of them (~10 MB)


def local_params_shared(spec: ExperimentSpec, rank: int) -> tuple[LocalParam, ...]:
    """`local_params(spec, rank)` as one shared tuple per distinct input, memoised on everything local_params reads
    (the model's parameter list, the degrees, the schedule's stage placement, FSDP or not, the rank): the planner
    and the step-time model ask for the same ranks of the same layouts again and again. LocalParam is frozen."""
    m, p = spec.model, spec.parallel
    key = (model_key(m), p.tp, p.pp, p.dp, p.cp, p.ep, p.etp, p.virtual_stages, str(p.pp_schedule), p.zero_stage >= 2,
           rank)
    hit = _LOCAL_MEMO.get(key)
    if hit is None:
        if len(_LOCAL_MEMO) >= _MEMO_MAX:
            _LOCAL_MEMO.clear()
            _DERIVED.clear()  # it holds the tuples alive too
        hit = _LOCAL_MEMO[key] = tuple(local_params(spec, rank))
    return hit


def local_params_cached(spec: ExperimentSpec, rank: int) -> list[LocalParam]:
    """`local_params(spec, rank)` from local_params_shared's memo (a fresh list)."""
    return list(local_params_shared(spec, rank))


def derived(params: Sequence[LocalParam], tag: Any, fn: Callable[[Sequence[LocalParam]], Any], keep: Any = None) -> Any:
    """fn(params), memoised per (params object, tag) when `params` is a shared tuple (local_params_shared); the memo
    holds the tuple itself, so its id cannot be reused while the entry lives, and `keep` likewise (an object whose
    id(...) the tag carries, e.g. the hardware). Any other sequence: fn(params)."""
    if not isinstance(params, tuple):
        return fn(params)
    key = (id(params), tag)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is params and hit[1] is keep:
        return hit[2]
    if len(_DERIVED) >= 16 * _MEMO_MAX:
        _DERIVED.clear()
    value = fn(params)
    _DERIVED[key] = (params, keep, value)
    return value


def shard_param(info: ParamInfo, *, n_experts: int, tp: int, dp: int, ep: int, tp_rank: int, dp_rank: int, ep_rank: int,
                fsdp: bool, etp: int = 1) -> LocalParam | None:
    """One parameter on one rank after the tp/ep split and the data-parallel flavour (None: another ep rank's
    expert)."""
    name = info.name
    # everything below reads the name only through these three (every layer's q/k/v/... shard alike): memoised
    read = (info.shape, tp_style(name), name.endswith(".bias"), expert_of(name))
    key = (*read, n_experts, tp, dp, ep, tp_rank, dp_rank, ep_rank, fsdp, etp)
    split = _SPLIT.get(key, _MISS)
    if split is _MISS:
        if len(_SPLIT) >= 1 << 15:
            _SPLIT.clear()
        split = _SPLIT[key] = shard_split(*read, n_experts=n_experts, tp=tp, dp=dp, ep=ep, tp_rank=tp_rank,
                                           dp_rank=dp_rank, ep_rank=ep_rank, fsdp=fsdp, etp=etp)
    return None if split is None else LocalParam(name, info.shape, *split)


_SPLIT: dict[tuple, tuple | None] = {}
_MISS = object()


def shard_split(shape: tuple[int, ...], style: str, bias: bool, expert_index: int | None, *, n_experts: int, tp: int,
                 dp: int, ep: int, tp_rank: int, dp_rank: int, ep_rank: int, fsdp: bool, etp: int = 1) -> tuple | None:
    """shard_param's fields after name and shape, from what it reads of the name: its tp style, the .bias suffix and
    its expert index (so shard_param and _run_splits memoise it on those)."""
    if not _ep_keeps(expert_index, n_experts, ep, ep_rank):
        return None
    expert = expert_index is not None
    # expert replicas: the dp ranks with the same ep coordinate (dp index // ep within them); the ep
    # strategy keeps them out of the dp wrapper (DDP ignore list / fully_shard ignored_params)
    ep_expert = expert and ep > 1
    group, idx = (dp // ep, dp_rank // ep) if ep_expert else (dp, dp_rank)
    # ep > 1: experts split over etp ranks of the tp group by their tp style, whole at etp 1 (expert_layout.py); the
    # rest split over tp by its tp style
    local = (_tp_local(shape, style, bias, etp, tp_rank % etp) if ep_expert
             else _tp_local(shape, style, bias, tp, tp_rank))
    if fsdp and not ep_expert:
        rows, real = chunk_rows(local[0], group, idx)
        rest = prod(local[1:])
        storage, owned = rows * rest, real * rest
    else:
        storage = owned = prod(local)
    return local, storage, owned, group, idx, expert


def zero1_owned(params: list[LocalParam], dp: int, dp_rank: int) -> list[LocalParam]:
    """The parameters whose optimizer state ZeRO-1 keeps on `dp_rank`, in the local optimizer's order
    (largest first, as `_partition_parameters` appends them). The local list is identical on every dp
    rank of a (pp, tp, ep) position, so the partition is too."""
    return zero1_owned_all(params, dp)[dp_rank]


def zero1_owned_all(params: list[LocalParam], dp: int) -> list[list[LocalParam]]:
    """`zero1_owned(params, dp, r)` for every r in range(dp) from one partition."""
    numels = [q.local_numel for q in params]
    owner = zero1_partition(numels, dp)
    out: list[list[LocalParam]] = [[] for _ in range(dp)]
    for i in sorted(range(len(params)), key=lambda j: numels[j], reverse=True):
        out[owner[i]].append(params[i])
    return out


def first_short_chunk(dims: set[int], n: int) -> int:
    """Smallest index r < n whose `torch.chunk(x, n)` chunk of some dim in `dims` is shorter than ceil(d/n)
    (tail or empty chunk), n if none: ranks below it get identical chunk sizes on every dim."""
    first = n
    for d in dims:
        if d > 0:
            first = min(first, d // ceil(d / n))
    return first


def unsharded_numel(params: list[LocalParam]) -> int:
    """Elements of the unsharded (all-gathered) FSDP2 tensors: group size x padded shard."""
    return sum(q.storage_numel * q.dp_group for q in params)


def unsharded_grad_numel(q: LocalParam, tp: int) -> int:
    """Elements of the gradient autograd gives FSDP2's unsharded (TP-local) parameter. DTensor's vocab-parallel
    embedding backward returns it Replicate, the full (V, h) / (s, h) tensor; backend/strategies/tp.py
    `_grad_like_param` slices only the original parameter's grad, and FSDP2 / replicate compute with their own
    unsharded parameter, whose grad is redistributed to Shard only at reduce time
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `_get_grad_inner_tensor`)."""
    return prod(q.shape) if tp > 1 and tp_style(q.name) == VOCAB_ROWWISE else q.local_numel


def fsdp_units(m: ModelSpec, params: Sequence[LocalParam]) -> dict[str, list[LocalParam]]:
    """FSDP2 units as the engine wraps them: one per transformer block, the rest in the root."""
    units: dict[str, list[LocalParam]] = {}
    for q in params:
        parts = q.name.split(".")
        key = f"layers.{parts[1]}" if parts[0] == "layers" else "root"
        units.setdefault(key, []).append(q)
    return units
