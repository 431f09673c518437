"""A cheaper step-time estimate for ranking many layouts at once: a named approximation of model.step_time whose
fields are computed by the step-time model's own functions (compute.gemm_s / attention_pass / elementwise_pass /
head_pass, collectives.bandwidth_s, textbook/pipeline.bubble_over_ideal) on arrays of layouts.

What it leaves out, by design (each is a field of the exact model): the simulated pipeline schedule (the analytic
bubble instead), per-collective latency (bandwidth terms only), the stage-by-stage cost (the busiest pipeline
rank's layers at one layer's cost), the host's DTensor dispatch, the kernel launches of the optimizer and of the
loss's softmax passes, and, under full recompute, lm_head's GEMM re-run in backward. The planner
ranks every layout with it, then re-times a pool of the fastest with model.step_time, which it reports.
Measured agreement with step_time over every fitting layout: see tests/test_planner_core.py and
benchmarks/planner_speed.py (Spearman > 0.95 on the issue's 70B / TinyLlama cases).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from backend.analytic.layout import SCHEDULE_NAMES, Layout, RankPosition, RecomputeMode, ZeroStage
from backend.analytic.memory.parts import local_part, rank_parts, stage_composition
from backend.analytic.params import model_key
from backend.analytic.sharding import expert_of
from backend.analytic.steptime.collectives import bandwidth_s, group_stride, link_bandwidth, node_members, within_node
from backend.analytic.steptime.compute import attention_pass, elementwise_pass, gemm_s, head_pass, memory_s
from backend.analytic.steptime.cp_ring import ring_time
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.textbook.pipeline import bubble_formula
from backend.analytic.traffic import DDP_BUCKET_BYTES, MASTER_BYTES, fsdp_gathers_per_step
from backend.analytic.vector import any_true, logical_or, maximum, minimum, select_present, where

OPTIMIZER_BYTES_PER_ELEMENT = {"adamw": 28, "sgd": 20}
"""AdamW reads p, g, m, v and writes p, m, v (7 fp32 tensors); SGD with momentum 5 (model._optimizer_s)."""


@dataclass(frozen=True)
class StepProxy:
    """Seconds per step of every layout (arrays), by term."""
    compute_s: Any
    """All microbatches through the busiest pipeline rank: GEMMs, attention, element-wise, head (+ recompute)."""
    tp_comm_s: Any
    """TP activation all-reduces (4 per layer and microbatch), bandwidth only, all exposed."""
    cp_comm_s: Any
    """CP's ring K/V transfers the attention blocks do not hide (cp_ring.py; allgather, torch's default)."""
    bubble: Any
    """Pipeline idle time / ideal time of the schedule (textbook/pipeline.bubble_over_ideal)."""
    dp_exposed_s: Any
    """Data-parallel sync the compute does not hide (DDP's last bucket, FSDP2's first gather / last scatter)."""
    optimizer_s: Any
    """The optimizer's and zero_grad's memory passes."""
    overhead_s: float

    @property
    def step_s(self) -> Any:
        return (self.compute_s + self.tp_comm_s + self.cp_comm_s) * (1 + self.bubble) + self.dp_exposed_s + self.optimizer_s \
            + self.overhead_s


@lru_cache(maxsize=256)
def _block_linears(key: Any, tp: int) -> tuple[tuple[int, int, bool], ...]:
    """(out, in, is_expert) of one block's local Linear weights at tp index 0 (the core's placement)."""
    return tuple((*q.local_shape, expert_of(q.name) is not None)
                 for q in local_part(key, "block", False, (tp, 1, 1, 0, 0, 0, 0)) if len(q.shape) == 2)


def _layer_gemm_s(model: Any, layout: Layout, hw: Hardware) -> Any:
    """One layer's forward GEMMs (compute._weights_cost: experts see tokens·top_k·ep/E rows under uniform routing),
    added in the block's parameter order; each distinct GEMM shape is timed once."""
    key, peak, cb = model_key(model), hw.peak(layout.precision), layout.compute_bytes
    tokens = layout.micro_batch * layout.seq_local(model)
    total = np.zeros(np.shape(layout.tp), dtype=np.float64)
    for tp in np.unique(layout.tp).tolist():
        rows = np.nonzero(layout.tp == tp)[0]
        dense, routed = tokens[rows], tokens[rows] * (model.top_k * layout.ep[rows] / max(model.n_experts, 1))
        timed: dict[tuple[int, int, bool], Any] = {}
        acc = 0.0
        for shape in _block_linears(key, tp):
            seconds = timed.get(shape)
            if seconds is None:
                n_out, k, expert = shape
                seconds = timed[shape] = gemm_s(hw, peak, routed if expert else dense, k, n_out, cb)
            acc = acc + seconds
        total[rows] = acc
    return total


def _bubble(layout: Layout) -> Any:
    """textbook/pipeline.bubble_formula of each layout's schedule (0 without pipelining)."""
    m = np.maximum(layout.microbatches, 1)
    present = np.unique(layout.schedule).tolist()
    by_schedule = {k: bubble_formula(SCHEDULE_NAMES[k], p=layout.pp, m=m, v=layout.virtual_stages) for k in present}
    return where(layout.pp > 1, select_present(layout.schedule, by_schedule), 0.0)


def step_proxy(model: Any, layout: Layout, hw: Hardware, *, gpus_per_node: int) -> StepProxy:
    """The proxy's terms for every layout of an array Layout (flash attention, as on a GPU)."""
    tokens, cb, mb = layout.micro_batch * layout.seq_local(model), layout.compute_bytes, layout.microbatches
    attention, elementwise = attention_pass(model, layout, hw, "flash"), elementwise_pass(model, layout, hw)
    head = head_pass(model, layout, hw, kernel_launches=False)
    gemm = _layer_gemm_s(model, layout, hw)
    full, selective = layout.recompute == RecomputeMode.FULL, layout.recompute == RecomputeMode.SELECTIVE
    forward = gemm + attention.fwd_s + elementwise.fwd_s
    backward = 2 * gemm + attention.bwd_s + elementwise.bwd_s  # dgrad + wgrad
    per_layer = forward * (1 + full) + backward + where(selective, attention.fwd_s, 0.0)
    lm_head = 3 * gemm_s(hw, hw.peak(layout.precision), tokens, model.d_model, model.vocab_size / layout.tp, cb) \
        + head.fwd_s + head.bwd_s
    # the busiest pipeline rank: rank 0 (most layers; under ZBV also the last stage's head) or the last stage's rank;
    # rank 0's tp-local elements are the part sums the memory core uses (local sizes do not depend on dp sharding)
    rank0 = rank_parts(model, layout, RankPosition())
    first_rank, last_rank = rank0.stages, stage_composition(model, layout, layout.pp - 1)
    head_on_first = logical_or(layout.pp == 1, layout.zbv)
    busiest = maximum(first_rank.n_blocks * per_layer + head_on_first * lm_head,
                      where(head_on_first, 0.0, last_rank.n_blocks * per_layer + lm_head))
    compute = mb * busiest
    intra_tp = within_node(1, layout.tp, "tp", gpus_per_node)
    tp_payload = 4 * first_rank.n_blocks * mb * tokens * model.d_model * cb  # Shoeybi 2019 Sec 3: 2 fwd + 2 bwd
    tp_comm = where(layout.tp > 1, where(full, 1.5, 1.0) * bandwidth_s(hw, intra_tp, "all_reduce", tp_payload, layout.tp), 0.0)
    cp_comm = 0.0
    if any_true(layout.cp > 1):
        ring = ring_time(model, layout, hw, attention, rotate="allgather", gpus_per_node=gpus_per_node)
        cp_comm = mb * first_rank.n_blocks * (ring.fwd_exposed_s + ring.bwd_exposed_s)
    local = rank0.total("local_numel")
    dp_exposed = _dp_exposed(layout, hw, gpus_per_node, local, first_rank.n_blocks,
                             backward_s=first_rank.n_blocks * backward, compute_s=compute)
    owned = local / where(layout.zero_stage >= ZeroStage.ZERO1, layout.dp_cp, 1)
    per_element = OPTIMIZER_BYTES_PER_ELEMENT.get(layout.optimizer, OPTIMIZER_BYTES_PER_ELEMENT["adamw"])
    optimizer = memory_s(hw, per_element * owned, kernels=0) \
        + memory_s(hw, MASTER_BYTES * local / where(layout.fsdp, layout.dp_cp, 1), kernels=0)  # zero_grad
    return StepProxy(compute_s=compute, tp_comm_s=tp_comm, cp_comm_s=cp_comm, bubble=_bubble(layout), dp_exposed_s=dp_exposed,
                     optimizer_s=optimizer, overhead_s=hw.tune.step_overhead_s)


def _dp_exposed(layout: Layout, hw: Hardware, gpus_per_node: int, local: Any, n_blocks: Any, *, backward_s: Any,
                compute_s: Any) -> Any:
    """dp_sync.dp_exposed without latency: DDP / ZeRO-1's bucketed all-reduce behind the last backward (its last
    25 MB bucket exposed) and ZeRO-1's parameter broadcast after the step; FSDP2's gathers / reduce-scatters behind
    the whole step's compute (the first gather and last reduce-scatter exposed) plus their copy-in / copy-out."""
    dp, eta = layout.dp_cp, hw.tune.overlap_efficiency
    stride = group_stride(layout.tp, dp, "dp")
    intra, per_node = within_node(stride, dp, "dp", gpus_per_node), node_members(stride, dp, gpus_per_node)

    link = link_bandwidth(hw, intra, per_node)

    def coll(kind: str, payload: Any) -> Any:
        return bandwidth_s(hw, intra, kind, payload, dp, link_bytes_per_s=link)

    grads = MASTER_BYTES * local
    all_reduce = coll("all_reduce", grads)
    ddp = maximum(all_reduce - eta * backward_s, coll("all_reduce", minimum(grads, DDP_BUCKET_BYTES)))
    ddp = ddp + where(layout.zero_stage == ZeroStage.ZERO1, coll("broadcast", grads), 0.0)
    gathers = fsdp_gathers_per_step(layout.zero_stage, layout.microbatches, pipelined=layout.pipelined)
    scatters = where(layout.pipelined, 1, layout.microbatches)
    param_bytes = layout.fsdp_param_bytes
    gather_s, scatter_s = coll("all_gather", param_bytes * local), coll("reduce_scatter", grads)
    copies = memory_s(hw, 2 * (gathers * param_bytes + scatters * MASTER_BYTES) * local, kernels=0)
    fsdp = copies + maximum(gathers * gather_s + scatters * scatter_s - eta * compute_s,
                            2 * maximum(gather_s, scatter_s) / (n_blocks + 1))  # one unit's
    return where(dp > 1, where(layout.fsdp, fsdp, ddp), 0.0)


def proxy_step_s(model: Any, layout: Layout, hw: Hardware, *, gpus_per_node: int) -> Any:
    return step_proxy(model, layout, hw, gpus_per_node=gpus_per_node).step_s

