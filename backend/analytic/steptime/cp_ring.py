"""Ring attention's K/V traffic per layer and microbatch and how much of it the attention blocks hide (pure Python;
scalars or arrays of layouts).

torch's ring, `_templated_ring_attention` (stacks shardlab, torchtitan, deepspeed; strategies/ring_attention.py runs
the same one on CPU ranks): cp steps per attention call, each computing one block (1/cp of the rank's attention)
while the next block's K/V is in flight (Liu et al. 2023, "Ring Attention with Blockwise Transformers", Sec 3:
overlap when the block's compute outlasts the transfer).
- alltoall: forward cp - 1 hops of K/V, each hidden behind one block; backward cp - 1 hops of K/V plus a hop of the
  fp32 dK/dV accumulators after every block (cp of them), the last one after the last block, exposed.
- allgather: forward one all-gather of every rank's K/V, waited for after the first (local) block; backward the same
  all-gather, then the dK/dV hops as above.
Transformer Engine's ring (stack megatron; traffic.TE_RING_SOURCE), K/V at the GQA width, dK/dV in the compute dtype:
- p2p (alltoall): forward as torch's; backward step 0 sends K/V, steps 1 .. cp - 2 K/V and the dK/dV so far in one
  buffer, step cp - 1 the dK/dV alone, each behind that step's block.
- all_gather: the K/V all-gather before any block (forward, and again in backward), then one reduce-scatter of the
  gathered dK/dV after the last block: nothing hidden.
A hop is a send of the buffer to the next rank (α + bytes / link); the all-gather the ring collective (collectives.py).
Recompute (full, or selective's checkpointed core) runs the forward's ring again in backward.
torch's ring traced by torch.compile (overlap=False; stack_knobs.StackKnobs.cp_ring_overlap) hides nothing: under
tracing a functional collective is waited for where it is issued (torch/distributed/_functional_collectives.py
`_maybe_wrap_tensor`: `if _are_we_tracing(): return wait_tensor(self)`), and Inductor moves collectives only under
`reorder_for_compute_comm_overlap`, off by default (torch/_inductor/config.py); so every K/V and dK/dV transfer,
forward and backward, runs between the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, RecomputeMode
from backend.analytic.scalar_or_array import maximum, where
from backend.analytic.steptime.collectives import bandwidth_s, group_stride, node_members, within_node
from backend.analytic.steptime.compute import PassCost
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.traffic import cp_ring_bytes

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class RingTime:
    """Seconds per layer and microbatch on one rank (scalars or arrays)."""
    fwd_exposed_s: Num
    bwd_exposed_s: Num
    """Including the re-run forward's ring under recompute."""
    comm_s: Num
    """Every transfer before overlap (forward, backward, re-run forward)."""
    all_gather_s: Num
    all_to_all_s: Num
    reduce_scatter_s: Num = 0.0


def kv_bytes(model: ModelSpec, layout: Layout) -> tuple[Num, Num]:
    """(K and V of one attention call on one rank, their grads as the ring sends them): traffic.cp_ring_bytes."""
    return cp_ring_bytes(model, layout)


def ring_time(model: ModelSpec, layout: Layout, hw: Hardware, attention: PassCost, *, rotate: str,
              gpus_per_node: int, overlap: bool = True) -> RingTime:
    """`attention`: one layer and microbatch's attention pass on this rank (compute.attention_pass); overlap=False:
    torch's ring inside a compiled graph (module docstring)."""
    cp, eta = layout.cp, hw.tune.overlap_efficiency
    stride = group_stride(layout.tp, layout.dp_cp, "cp")
    intra = within_node(stride, cp, "cp", gpus_per_node)
    per_node = node_members(stride, cp, gpus_per_node)
    alpha = where(intra, hw.tune.intra_latency_s, hw.tune.inter_latency_s)
    kv, dkv = kv_bytes(model, layout)
    hop_kv = alpha + bandwidth_s(hw, intra, "send", kv, 2, per_node)
    hop_dkv = alpha + bandwidth_s(hw, intra, "send", dkv, 2, per_node)
    gather = (cp - 1) * alpha + bandwidth_s(hw, intra, "all_gather", cp * kv, cp, per_node)
    block_f, block_b = eta * attention.fwd_s / cp, eta * attention.bwd_s / cp
    rerun = layout.recompute != RecomputeMode.NONE
    forwards = where(rerun, 2, 1)
    if layout.te_ring:
        return _te_ring(RingCosts(cp, hop_kv, hop_dkv, gather, block_f, block_b, forwards),
                        rotate, (cp - 1) * alpha + bandwidth_s(hw, intra, "reduce_scatter", cp * dkv, cp, per_node))
    steps = cp - 1
    if rotate == "allgather":
        fwd = maximum(0.0, gather - block_f)
        bwd = maximum(0.0, maximum(gather, hop_dkv) - block_b) + maximum(0, steps - 1) * maximum(0.0, hop_dkv - block_b)
        forward_comm, gathers = gather, gather
    else:
        fwd = steps * maximum(0.0, hop_kv - block_f)
        bwd = steps * maximum(0.0, hop_kv + hop_dkv - block_b)
        forward_comm, gathers = steps * hop_kv, 0.0
    if not overlap:  # each transfer waited for where it is issued: forward's K/V, backward's K/V and its cp dK/dV hops
        fwd, bwd = forward_comm, forward_comm + steps * hop_dkv
    bwd = bwd + hop_dkv  # the accumulators' last hop home, after the last block
    bwd = bwd + where(rerun, fwd, 0.0)
    to_all = cp * hop_dkv + where(rotate == "allgather", 0.0, (forwards + 1) * forward_comm)
    gathered = (forwards + 1) * gathers
    on = cp > 1
    return RingTime(fwd_exposed_s=where(on, fwd, 0.0), bwd_exposed_s=where(on, bwd, 0.0),
                    comm_s=where(on, to_all + gathered, 0.0), all_gather_s=where(on, gathered, 0.0),
                    all_to_all_s=where(on, to_all, 0.0))


@dataclass(frozen=True)
class RingCosts:
    """One attention call's ring pieces on one rank (seconds; scalars or arrays)."""
    cp: Num
    hop_kv: Num
    hop_dkv: Num
    gather: Num
    block_f: Num
    block_b: Num
    forwards: Num
    """Forward runs per backward: 2 under recompute."""


def _te_ring(c: RingCosts, rotate: str, scatter: Num) -> RingTime:
    """Transformer Engine's ring (module docstring); `scatter`: the all_gather variant's dK/dV reduce-scatter."""
    on = c.cp > 1
    if rotate == "allgather":
        fwd, bwd = c.gather, c.gather + scatter
        bwd = bwd + where(c.forwards > 1, fwd, 0.0)
        gathered = (c.forwards + 1) * c.gather
        return RingTime(fwd_exposed_s=where(on, fwd, 0.0), bwd_exposed_s=where(on, bwd, 0.0),
                        comm_s=where(on, gathered + scatter, 0.0), all_gather_s=where(on, gathered, 0.0),
                        all_to_all_s=0.0, reduce_scatter_s=where(on, scatter, 0.0))
    both = c.hop_kv + c.hop_dkv
    fwd = (c.cp - 1) * maximum(0.0, c.hop_kv - c.block_f)
    bwd = maximum(0.0, c.hop_kv - c.block_b) + maximum(0.0, c.hop_dkv - c.block_b) \
        + maximum(0, c.cp - 2) * maximum(0.0, both - c.block_b)
    bwd = bwd + where(c.forwards > 1, fwd, 0.0)
    hops = c.forwards * (c.cp - 1) * c.hop_kv + (c.cp - 1) * both
    return RingTime(fwd_exposed_s=where(on, fwd, 0.0), bwd_exposed_s=where(on, bwd, 0.0),
                    comm_s=where(on, hops, 0.0), all_gather_s=0.0, all_to_all_s=where(on, hops, 0.0))
