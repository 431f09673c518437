"""The step-time screen: a cheaper step-time estimate for ranking many layouts at once, a named approximation of
model.step_time whose fields are computed by the step-time model's own functions (compute.gemm_s / attention_pass /
elementwise_pass / head_pass, collectives.bandwidth_s, textbook/pipeline.bubble_over_ideal) on arrays of layouts.

What it leaves out, by design (each is a field of the exact model): the simulated pipeline schedule (the analytic
bubble instead), per-collective latency (bandwidth terms only), the stage-by-stage cost (the busiest pipeline
rank's layers at one layer's cost per block kind: dense / MoE, global / windowed attention), the host's DTensor
dispatch, the kernel launches of the optimizer and of the loss's softmax passes, torchao's float8 casts
(float8_casts.py: memory passes beside the fp8 GEMMs), and, under full recompute, lm_head's GEMM re-run in backward
(recompute_cost.py shares). The planner ranks every layout with it, then re-times a pool of the
fastest with model.step_time, which it reports. Measured agreement with step_time over every fitting layout: see
tests/unit/test_planner_core.py and benchmarks/planner_speed.py (Spearman > 0.95 on the issue's 70B / TinyLlama cases).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.ep_dispatch import Dispatch, all_to_all_payload_bytes
from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.layout import SCHEDULE_NAMES, Layout, RankPosition, ZeroStage
from backend.analytic.memory.parts import (
    ALT_PART,
    StageComposition,
    attention_kind_counts,
    is_mixed,
    local_part,
    moe_blocks,
    part_sums,
    rank_parts,
    stage_composition,
)
from backend.analytic.moe_rows import is_uniform_dropless, moe_rows_key
from backend.analytic.moe_rows import of_model as expert_rows_of
from backend.analytic.params import ModelKey, layer_attention_kind, model_key
from backend.analytic.recompute_cost import rerun_share
from backend.analytic.scalar_or_array import (
    any_true,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    per_distinct,
    select_present,
    where,
)
from backend.analytic.sharding import expert_of
from backend.analytic.steptime.collectives import (
    bandwidth_s,
    group_stride,
    link_bandwidth,
    node_members,
    within_node,
)
from backend.analytic.steptime.compute import (
    PassCost,
    attention_pass,
    default_implementation,
    elementwise_pass,
    head_pass,
    memory_s,
    param_pass,
    weight_gemms_s,
)
from backend.analytic.steptime.cp_ring import ring_time
from backend.analytic.steptime.ep_comm import dispatcher_bandwidth_s
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import OPTIMIZER_IMPL, PRECISION_DTYPE, optimizer_time
from backend.analytic.textbook.pipeline import bubble_formula
from backend.analytic.traffic import DDP_BUCKET_BYTES, MASTER_BYTES, fsdp_gathers_per_step

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

OPTIMIZER_BYTES_PER_ELEMENT = {"adamw": 28, "sgd": 20}
"""AdamW reads p, g, m, v and writes p, m, v (7 fp32 tensors); SGD with momentum 5 (model._optimizer_s)."""


@dataclass(frozen=True)
class StepScreen:
    """Seconds per step of every layout (arrays), by term."""
    compute_s: Num
    """All microbatches through the busiest pipeline rank: GEMMs, attention, element-wise, head (+ recompute)."""
    tp_comm_s: Num
    """TP activation all-reduces (4 per layer and microbatch), bandwidth only, all exposed."""
    ep_comm_s: Num
    """EP all-to-alls (4 per MoE block and microbatch), bandwidth only, all exposed."""
    cp_comm_s: Num
    """CP's ring K/V transfers the attention blocks do not hide (cp_ring.py; torch's default allgather, or
    Transformer Engine's default p2p under stack megatron)."""
    bubble: Num
    """Pipeline idle time / ideal time of the schedule (textbook/pipeline.bubble_over_ideal)."""
    dp_exposed_s: Num
    """Data-parallel sync the compute does not hide (DDP's last bucket, FSDP2's first gather / last scatter)."""
    optimizer_s: Num
    """The optimizer's and zero_grad's memory passes."""
    overhead_s: Num
    """The fixed step overhead and zero3's exposed FSDP2 hook time."""

    @property
    def step_s(self) -> Num:
        return (self.compute_s + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s) * (1 + self.bubble) \
            + self.dp_exposed_s + self.optimizer_s + self.overhead_s


@lru_cache(maxsize=256)
def _block_linears(key: ModelKey, tp: int, part: str = "block", ep: int = 1) -> tuple[tuple[int, int, bool], ...]:
    """(out, in, is_expert) of one block's local Linear weights at tp index 0 (the core's placement: an ep rank holds
    n_experts / ep experts); part: block (block 0's MLP kind) or parts.ALT_PART (the other kind's, mixed stacks)."""
    return tuple((*q.local_shape, expert_of(q.name) is not None)
                 for q in local_part(key, part, False, (tp, ep, ep, 0, 0, 0, 0)) if len(q.shape) == 2)


def _groups(*columns: Num) -> tuple[np.ndarray, np.ndarray]:
    """(one representative row per distinct combination, each row's combination) of small non-negative int columns
    (broadcast), without sorting: each column coded by its distinct values (_distinct), the codes in mixed radix."""
    cols = np.broadcast_arrays(*(np.asarray(c, dtype=np.int64) for c in columns))
    key = np.zeros(cols[0].size, dtype=np.int64)
    span = 1
    for c in cols:
        values, code = _distinct(c.ravel())
        key, span = key * len(values) + code, span * len(values)
    groups, group_of = _distinct(key) if span > 4 * key.size + 1024 else _bin_groups(key, span)
    rep = np.empty(len(groups), dtype=np.int64)
    rep[group_of] = np.arange(key.size)
    return rep, group_of


def _bin_groups(key: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    present = np.zeros(span, dtype=bool)
    present[key] = True
    groups = np.flatnonzero(present)
    lookup = np.zeros(span, dtype=np.int64)
    lookup[groups] = np.arange(len(groups))
    return groups, lookup[key]


def _layer_gemm_s(model: ModelSpec, layout: Layout, hw: Hardware, part: str = "block") -> tuple[Num, Num]:
    """One layer's (forward, backward) GEMMs (compute.weights_cost: forward, dgrad and wgrad shapes; experts see
    tokens·top_k·ep/E rows under uniform routing; a cp rank's seq_len / cp tokens), added in the block's parameter
    order; timed once per distinct (tp, micro-batch, ep, cp) and profile. part: as _block_linears."""
    key = model_key(model)
    if not isinstance(layout.tp, np.ndarray):
        return _one_layer_gemms(model, layout, hw, key, (int(layout.tp), int(layout.micro_batch), int(layout.ep),
                                                         int(layout.cp)), part)
    _prefill_gemm_table(model, layout, hw, key)
    tp, mb, ep, cp = (np.broadcast_to(np.asarray(c), np.shape(layout.tp))
                      for c in (layout.tp, layout.micro_batch, layout.ep, layout.cp))
    rep, group = _groups(tp, mb, ep if model.is_moe else 0, cp)
    pairs = np.asarray([_one_layer_gemms(model, layout, hw, key, (int(tp[i]), int(mb[i]), int(ep[i]), int(cp[i])), part)
                        for i in rep.tolist()], dtype=float)
    return pairs[group, 0], pairs[group, 1]


def _one_layer_gemms(model: ModelSpec, layout: Layout, hw: Hardware, key: ModelKey, sizes: tuple[int, int, int, int],
                     part: str) -> tuple[float, float]:
    """sizes: (tp, micro-batch, ep, cp)."""
    tp, mb, ep, cp = sizes
    memo_key = ("layer gemms", key, layout.precision, tp, mb, ep if model.is_moe else 0, cp, part, model.top_k,
                *moe_rows_key(model))  # the expert rows read more than the parameter shapes (moe_rows.of_model)
    hit = hw.memo.get(memo_key)
    if hit is None:
        tokens = mb * (model.seq_len // cp)
        routed = tokens * model.top_k * ep / max(model.n_experts, 1)
        if model.is_moe and ep > 1 and not is_uniform_dropless(model):  # the busiest rank's rows per local expert
            routed = expert_rows_of(model, tokens).received * ep / model.n_experts
        f = b = 0.0
        fp8 = layout.precision == "fp8"  # the block's dense Linears are float8 (strategies/float8.py); experts are not
        seen: dict[tuple[int, int, bool], tuple[float, float]] = {}  # a MoE block repeats each expert's shapes E times
        for shape in _block_linears(key, tp, part, ep if model.is_moe else 1):
            sf, sb = seen.get(shape) or seen.setdefault(shape, weight_gemms_s(
                hw, layout.precision, routed if shape[2] else tokens, shape[1], shape[0], layout.compute_bytes,
                float8=fp8 and not shape[2]))
            f, b = f + sf, b + sb  # added one by one, in the block's order: the same floats as timing each
        hit = hw.memo[memo_key] = (f, b)
    return hit


def _prefill_gemm_table(model: ModelSpec, layout: Layout, hw: Hardware, key: ModelKey) -> None:
    """Interpolate every dense GEMM shape of the layouts (forward, dgrad, wgrad of each block weight and lm_head) in
    one batch, so the per-shape lookups below find them in the table's memo."""
    table = hw.tables.gemm_table(PRECISION_DTYPE.get(layout.precision, layout.precision))
    if table is None:
        return
    mbs, tps = _distinct(np.asarray(layout.micro_batch))[0].tolist(), _distinct(np.asarray(layout.tp))[0].tolist()
    cps = _distinct(np.asarray(layout.cp))[0].tolist()
    done = ("gemm prefill", key, layout.precision, tuple(mbs), tuple(tps), tuple(cps))
    if done in hw.memo:
        return
    hw.memo[done] = True
    queries = []
    for tp in tps:
        shapes = [(n, k) for n, k, expert in _block_linears(key, tp)
                  if not expert] + [(model.vocab_size / tp, model.d_model)]
        for mb in mbs:
            for cp in cps:
                t = mb * (model.seq_len // cp)
                for n, k in shapes:
                    queries += [(t, k, n), (t, n, k), (k, t, n)]
    q = np.asarray(queries, dtype=float)
    table.efficiency(q[:, 0], q[:, 1], q[:, 2])


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True) for non-negative ints of a small range without sorting (a bin table)."""
    v = values.astype(np.int64, copy=False)
    top = int(v.max()) + 1 if v.size else 1
    if top > 4 * v.size + 1024:
        return np.unique(v, return_inverse=True)
    present = np.bincount(v.ravel(), minlength=top) > 0
    distinct = np.flatnonzero(present)
    lookup = np.zeros(top, dtype=np.int64)
    lookup[distinct] = np.arange(len(distinct))
    return distinct, lookup[v]


def _head_gemms_s(hw: Hardware, layout: Layout, tokens: Num, model: ModelSpec, cb: float) -> tuple[Num, Num]:
    """lm_head's (forward, backward) GEMMs (tokens x d_model x vocab/tp), once per distinct (micro-batch, tp, cp)."""
    if not isinstance(tokens, np.ndarray) and not isinstance(layout.tp, np.ndarray):
        return weight_gemms_s(hw, layout.precision, tokens, model.d_model, model.vocab_size / layout.tp, cb)
    mb, tp, cp = np.broadcast_arrays(np.asarray(layout.micro_batch), np.asarray(layout.tp), np.asarray(layout.cp))
    rep, group = _groups(mb, tp, cp)
    pairs = np.asarray([weight_gemms_s(hw, layout.precision, int(mb.flat[i]) * (model.seq_len // int(cp.flat[i])),
                                       model.d_model, model.vocab_size / int(tp.flat[i]), cb) for i in rep.tolist()],
                       dtype=float)
    return pairs[group, 0].reshape(mb.shape), pairs[group, 1].reshape(mb.shape)


def _param_pass_s(model: ModelSpec, layout: Layout, hw: Hardware, stages: StageComposition, implementation: str) -> Num:
    """compute.stage_param_pass of a pipeline rank with composition `stages`, part by part: blocks x one block's
    passes (a mixed stack's other kind: its own block's), the embeddings on the first stage, norm and lm_head on the
    last; each part timed once per distinct (tp, ep, autocast, recompute, one stage) from its tp / ep-local sizes
    (memory/parts.part_sums)."""
    if implementation != "torch" or layout.uses_autocast is False:
        return 0.0
    key, tied, mixed = model_key(model), bool(model.tie_embeddings), is_mixed(model)

    def parts_s(tp: int, ep: int, autocast: int, recompute: int, single: int) -> tuple[float, float, float, float]:
        memo_key = ("param passes", key, layout.precision, tp, ep, autocast, recompute, single)
        hit = hw.memo.get(memo_key)
        if hit is None:
            one = Layout(tp=tp, ep=ep, recompute=recompute, precision=layout.precision)
            placement = (tp, ep, ep, 0, 0, 0, 0)
            blk, emb, head, alt = (part_sums(key, part, tied and part == "head" and not single, placement, False)
                                   for part in ("block", "embeddings", "head", ALT_PART if mixed else "block"))
            e_gemm = emb.token_embedding_numel if tied and single else 0
            sizes = tuple((b.linear_weight_numel, b.local_numel - b.linear_weight_numel,
                           _local_linears(key, tp, ep, part), b.tensors - _local_linears(key, tp, ep, part))
                          for b, part in ((blk, "block"), (alt, ALT_PART if mixed else "block"))) + (
                     (e_gemm, emb.local_numel - e_gemm, int(e_gemm > 0), emb.tensors - int(e_gemm > 0)),
                     (head.head_weight_numel, head.local_numel - head.head_weight_numel,
                      int(head.head_weight_numel > 0), head.tensors - int(head.head_weight_numel > 0)))
            costs = [param_pass(hw, one, sz, implementation, autocast=bool(autocast)) for sz in sizes]
            block_s = [c.fwd_s + c.bwd_s + c.recompute_s for c in costs[:2]]
            hit = hw.memo[memo_key] = (block_s[0], costs[2].fwd_s + costs[2].bwd_s, costs[3].fwd_s + costs[3].bwd_s,
                                       block_s[1])
        return hit

    per = per_distinct(parts_s, layout.tp, layout.ep, layout.uses_autocast, layout.recompute, layout.n_stages == 1)
    block, first, last, alt = (per[..., i] for i in range(4)) if isinstance(per, np.ndarray) else per
    return (stages.n_blocks - stages.n_alt) * block + stages.n_alt * alt + stages.first * first + stages.last * last


@lru_cache(maxsize=4096)
def _local_linears(key: ModelKey, tp: int, ep: int, part: str = "block") -> int:
    """2-D weights of one block (part: as _block_linears) on a rank of (tp, ep) (compute.stage_param_pass counts the
    same)."""
    return sum(1 for q in local_part(key, part, False, (tp, ep, ep, 0, 0, 0, 0)) if len(q.local_shape) == 2)


def _bubble(layout: Layout) -> Num:
    """textbook/pipeline.bubble_formula of each layout's schedule (0 without pipelining)."""
    m = np.maximum(layout.microbatches, 1)
    present = np.unique(layout.schedule).tolist()
    by_schedule = {k: bubble_formula(SCHEDULE_NAMES[k], p=layout.pp, m=m, v=layout.virtual_stages) for k in present}
    return where(layout.pp > 1, select_present(layout.schedule, by_schedule), 0.0)


def step_screen(model: ModelSpec, layout: Layout, hw: Hardware, *, gpus_per_node: int) -> StepScreen:
    """The screen's terms for every layout of an array Layout (flash attention, as on a GPU)."""
    tokens, cb, mb = layout.micro_batch * layout.seq_local(model), layout.compute_bytes, layout.microbatches
    implementation = default_implementation(hw)
    head = head_pass(model, layout, hw, kernel_launches=False)
    share = rerun_share(model, layout, flash=True)  # recompute_cost.py: what each policy re-runs in backward
    blocks = _BlockCosts(model, layout, hw, implementation, rerun=share)
    head_fwd, head_bwd = _head_gemms_s(hw, layout, tokens, model, cb)
    lm_head = head_fwd + head_bwd + head.fwd_s + head.bwd_s
    # the busiest pipeline rank: rank 0 (most layers; under ZBV also the last stage's head) or the last stage's rank;
    # rank 0's tp-local elements are the part sums the memory core uses (local sizes do not depend on dp sharding)
    rank0 = rank_parts(model, layout, RankPosition())
    first_rank, last_rank = rank0.stages, stage_composition(model, layout, layout.pp - 1)
    head_on_first = logical_or(layout.pp == 1, layout.zbv)
    busiest = maximum(blocks.of_rank(first_rank, 0) + head_on_first * lm_head
                      + _param_pass_s(model, layout, hw, first_rank, implementation),
                      where(head_on_first, 0.0, blocks.of_rank(last_rank, layout.pp - 1) + lm_head
                            + _param_pass_s(model, layout, hw, last_rank, implementation)))
    compute = mb * busiest
    intra_tp = within_node(1, layout.tp, "tp", gpus_per_node)
    tp_payload = 4 * first_rank.n_blocks * mb * tokens * model.d_model * cb  # Shoeybi 2019 Sec 3: 2 fwd + 2 bwd
    rerun_comm = 1.0 + 0.5 * share.gemm  # the re-run forward repeats its collectives (steptime.model: x1.5 under full)
    tp_comm = where(layout.tp > 1, rerun_comm * bandwidth_s(hw, intra_tp, "all_reduce", tp_payload, layout.tp), 0.0)
    cp_comm = 0.0
    if any_true(layout.cp > 1):
        rotate = "alltoall" if layout.te_ring else "allgather"  # as Layout.spec_dict plans it
        ring = ring_time(model, layout, hw, blocks.attention[0], rotate=rotate, gpus_per_node=gpus_per_node)
        cp_comm = mb * first_rank.n_blocks * (ring.fwd_exposed_s + ring.bwd_exposed_s)
    local, experts = rank0.total("local_numel"), rank0.total("ep_expert_numel")
    backward_s = first_rank.n_blocks * blocks.backward_s
    dp_exposed = _dp_exposed(layout, hw, gpus_per_node, local - experts, first_rank.n_blocks,
                             backward_s=backward_s, compute_s=compute) \
        + _expert_sync_exposed(layout, hw, gpus_per_node, experts, backward_s=backward_s)
    # steptime.model._optimizer_s's elements: ZeRO-2/3 the rank's real (unpadded) shard, ZeRO-1 1/dp of its local ones
    owned = where(layout.zero_stage >= ZeroStage.ZERO2, rank0.total("real_numel"),
                  local / where(layout.zero_stage == ZeroStage.ZERO1, layout.dp_cp, 1))
    per_element = OPTIMIZER_BYTES_PER_ELEMENT.get(layout.optimizer, OPTIMIZER_BYTES_PER_ELEMENT["adamw"])
    step = memory_s(hw, per_element * owned, kernels=0) if hw.kind == "cpu" else \
        optimizer_time(hw, owned, OPTIMIZER_IMPL[implementation], per_element_bytes=per_element)
    optimizer = step + memory_s(hw, MASTER_BYTES * rank0.total("storage_numel"), kernels=0)  # zero_grad
    ep_comm = rerun_comm * _ep_comm_s(model, layout, hw, gpus_per_node, moe_blocks=blocks.moe_blocks(first_rank))
    return StepScreen(compute_s=compute, tp_comm_s=tp_comm, ep_comm_s=ep_comm, cp_comm_s=cp_comm,
                      bubble=_bubble(layout), dp_exposed_s=dp_exposed, optimizer_s=optimizer,
                     overhead_s=hw.tune.step_overhead_s + _fsdp_host_s(layout, hw, first_rank))


def _fsdp_host_s(layout: Layout, hw: Hardware, stages: StageComposition) -> Num:
    """dp_sync.fsdp_host_s: zero3's pre-backward hook per FSDP2 unit (blocks + root) and microbatch."""
    wrapped = logical_and(layout.zero_stage == ZeroStage.ZERO3,
                          logical_or(layout.dp_cp > 1, logical_not(layout.is_mix)))
    return where(wrapped, hw.tune.fsdp_unit_host_s * (stages.n_blocks + 1) * layout.microbatches, 0.0)


class _BlockCosts:
    """Seconds of one microbatch through a rank's blocks, per kind: dense / MoE blocks (mixed stacks: the alt part's
    GEMMs) and global / windowed attention (compute.attention_pass with windowed=True)."""

    def __init__(self, model: ModelSpec, layout: Layout, hw: Hardware, implementation: str, *, rerun: Num):
        self.model, self.layout, self.rerun = model, layout, rerun
        self.mixed = is_mixed(model)
        attention = attention_pass(model, layout, hw, "flash")
        self.elementwise = elementwise_pass(model, layout, hw, implementation)
        windowed = attention_pass(model, layout, hw, "flash", windowed=True) \
            if getattr(model, "window", None) is not None else attention
        self.attention = (attention, windowed)
        self.gemm = (_layer_gemm_s(model, layout, hw),
                     _layer_gemm_s(model, layout, hw, ALT_PART) if self.mixed else (0.0, 0.0))

    @property
    def backward_s(self) -> Num:
        """One block 0's backward (what DDP's bucketed all-reduce overlaps with, per block)."""
        return self.gemm[0][1] + self.attention[0].bwd_s + self.elementwise.bwd_s

    def _per_layer(self, gemm: tuple[Num, Num], attention: PassCost) -> Num:
        forward = gemm[0] + attention.fwd_s + self.elementwise.fwd_s
        backward = gemm[1] + attention.bwd_s + self.elementwise.bwd_s  # dgrad + wgrad
        rerun = self.rerun  # recompute_cost.RerunShare: the shares of the forward re-run in backward
        return forward + backward + rerun.gemm * gemm[0] + rerun.attention * attention.fwd_s \
            + rerun.elementwise * self.elementwise.fwd_s

    def of_rank(self, stages: StageComposition, pp_rank: Num) -> Num:
        """The blocks of a pipeline rank (StageComposition) at its own kinds."""
        layer = self._per_layer(self.gemm[0], self.attention[0])
        counts = attention_kind_counts(self.model, self.layout, pp_rank)
        if not self.mixed and counts is None:
            return stages.n_blocks * layer
        total = (stages.n_blocks - stages.n_alt) * layer
        if self.mixed:
            total = total + stages.n_alt * (self._per_layer(self.gemm[1], self.attention[0]))
        if counts is not None:  # windowed blocks' attention instead of a global one's
            global_attention, window = self.attention
            no_gemm = (0.0, 0.0)
            delta = self._per_layer(no_gemm, window) - self._per_layer(no_gemm, global_attention)
            _, n_windowed = counts
            total = total + (n_windowed - stages.n_blocks * layer_attention_kind(self.model, 0)[1]) * delta
        return total

    def moe_blocks(self, stages: StageComposition) -> Num:
        """MoE blocks of a pipeline rank."""
        return moe_blocks(self.model, stages)


def _ep_comm_s(model: ModelSpec, layout: Layout, hw: Hardware, gpus_per_node: int, *, moe_blocks: Num) -> Num:
    """EP's dispatch and combine of the busiest rank, forward and backward, bandwidth only, all exposed: the rows of
    tokens·top_k per MoE block and microbatch (traffic.ep_traffic, GShard Sec 3.1) as the model's dispatcher moves
    them, at the links steptime.model._mp_comm times them on (steptime/ep_comm.py)."""
    if not model.is_moe:
        return 0.0
    dispatch = Dispatch.of_layout(layout)  # the rows and their dtype as the stack's dispatcher sends them
    tokens = dispatch.layout_tokens(model, layout)
    row_bytes = dispatch.row_bytes(str(layout.precision))
    passes = layout.microbatches * moe_blocks
    payload = passes * all_to_all_payload_bytes(model, tokens, row_bytes)
    return dispatcher_bandwidth_s(model, layout, hw, gpus_per_node, payload=payload, sent_tokens=tokens, passes=passes)


def _dp_link(layout: Layout, hw: Hardware, gpus_per_node: int, group: Num) -> tuple[Num, Num]:
    """(within one node, bytes/s per rank) of a data-parallel group of `group` tp-strided ranks (dp_sync's tiers)."""
    stride = group_stride(layout.tp, group, "dp")
    intra = within_node(stride, group, "dp", gpus_per_node)
    return intra, link_bandwidth(hw, intra, node_members(stride, group, gpus_per_node))


def _dp_exposed(layout: Layout, hw: Hardware, gpus_per_node: int, local: Num, n_blocks: Num, *, backward_s: Num,
                compute_s: Num) -> Num:
    """dp_sync.dp_exposed without latency: DDP / ZeRO-1's bucketed all-reduce behind the last backward (its last
    25 MB bucket exposed) and ZeRO-1's parameter broadcast after the step; the distributed optimizer's
    reduce-scatter behind the last backward (one block's bucket exposed) and its param all-gather after the step;
    FSDP2's gathers / reduce-scatters behind the whole step's compute (the first gather and last reduce-scatter exposed)
    plus their copy-in / copy-out."""
    dp, eta = layout.dp_cp, hw.tune.overlap_efficiency
    intra, link = _dp_link(layout, hw, gpus_per_node, dp)

    def coll(kind: str, payload: Num) -> Num:
        return bandwidth_s(hw, intra, kind, payload, dp, link_bytes_per_s=link)

    grads = MASTER_BYTES * local
    all_reduce = coll("all_reduce", grads)
    ddp = maximum(all_reduce - eta * backward_s, coll("all_reduce", minimum(grads, DDP_BUCKET_BYTES)))
    ddp = ddp + where(layout.zero_stage == ZeroStage.ZERO1, coll("broadcast", grads), 0.0)
    scatter_bucket = coll("reduce_scatter", grads / (n_blocks + 1))  # the distributed optimizer's last bucket
    distributed = maximum(coll("reduce_scatter", grads) - eta * backward_s, scatter_bucket) \
        + coll("all_gather", where(layout.half_params, layout.compute_bytes, MASTER_BYTES) * local)
    ddp = where(layout.distributed_optimizer, distributed, ddp)
    gathers = fsdp_gathers_per_step(layout.zero_stage, layout.microbatches, pipelined=layout.pipelined)
    scatters = where(layout.pipelined, 1, layout.microbatches)
    param_bytes = layout.fsdp_param_bytes
    gather_s, scatter_s = coll("all_gather", param_bytes * local), coll("reduce_scatter", grads)
    copies = memory_s(hw, 2 * (gathers * param_bytes + scatters * MASTER_BYTES) * local, kernels=0)
    fsdp = copies + maximum(gathers * gather_s + scatters * scatter_s - eta * compute_s,
                            2 * maximum(gather_s, scatter_s) / (n_blocks + 1))  # one unit's
    return where(dp > 1, where(layout.fsdp, fsdp, ddp), 0.0)


def _expert_sync_exposed(layout: Layout, hw: Hardware, gpus_per_node: int, experts: Num, *, backward_s: Num) -> Num:
    """ep.sync_expert_grads as dp_sync times it: the routed experts' fp32 grads all-reduced over the expert-replica
    group (dp x cp / ep ranks) behind the last backward, its last 25 MB bucket exposed, bandwidth only; under the
    distributed optimizer (zero1) a reduce-scatter of the expert buckets over edp behind the last backward and the
    all-gather of their params after the step."""
    group = ExpertLayout.of_layout(layout).edp
    intra, link = _dp_link(layout, hw, gpus_per_node, group)
    grads = MASTER_BYTES * experts

    def coll(kind: str, payload: Num) -> Num:
        return bandwidth_s(hw, intra, kind, payload, group, link_bytes_per_s=link)

    eta = hw.tune.overlap_efficiency
    exposed = maximum(coll("all_reduce", grads) - eta * backward_s,
                      coll("all_reduce", minimum(grads, DDP_BUCKET_BYTES)))
    distributed = maximum(coll("reduce_scatter", grads) - eta * backward_s, coll("reduce_scatter", minimum(
        grads, DDP_BUCKET_BYTES))) + coll("all_gather",
                                          where(layout.half_params, layout.compute_bytes, MASTER_BYTES) * experts)
    exposed = where(layout.distributed_optimizer, distributed, exposed)
    return where((layout.ep > 1) & (group > 1), exposed, 0.0)


def screen_step_s(model: ModelSpec, layout: Layout, hw: Hardware, *, gpus_per_node: int) -> Num:
    return step_screen(model, layout, hw, gpus_per_node=gpus_per_node).step_s

