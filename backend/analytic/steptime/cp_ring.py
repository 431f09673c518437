"""Ring attention's K/V traffic per layer and microbatch and how much of it the attention blocks hide (pure Python;
scalars or arrays of layouts).

The schedule is torch's `_templated_ring_attention` (strategies/ring_attention.py runs the same one on CPU ranks):
cp steps per attention call, each computing one block (1/cp of the rank's attention) while the next block's K/V
is in flight (Liu et al. 2023, "Ring Attention with Blockwise Transformers", Sec 3: overlap when the block's compute
outlasts the transfer).
- alltoall: forward cp - 1 hops of K/V, each hidden behind one block; backward cp - 1 hops of K/V plus a hop of the
  fp32 dK/dV accumulators after every block (cp of them), the last one after the last block, exposed.
- allgather: forward one all-gather of every rank's K/V, waited for after the first (local) block; backward the same
  all-gather, then the dK/dV hops as above.
A hop is a send of the buffer to the next rank (α + bytes / link); the all-gather the ring collective (collectives.py).
Recompute (full, or selective's checkpointed core) runs the forward's ring again in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, RecomputeMode
from backend.analytic.scalar_or_array import maximum, where
from backend.analytic.steptime.collectives import bandwidth_s, group_stride, node_members, within_node
from backend.analytic.steptime.compute import PassCost
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.traffic import MASTER_BYTES

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


def kv_bytes(model: ModelSpec, layout: Layout) -> tuple[Num, Num]:
    """(K and V of one attention call on one rank in the compute dtype, their fp32 grads): traffic.cp_kv_bytes."""
    elems = 2 * layout.micro_batch * layout.seq_local(model) * (model.n_heads // layout.tp) * model.head_dim
    return elems * layout.compute_bytes, elems * MASTER_BYTES


def ring_time(model: ModelSpec, layout: Layout, hw: Hardware, attention: PassCost, *, rotate: str,
              gpus_per_node: int) -> RingTime:
    """`attention`: one layer and microbatch's attention pass on this rank (compute.attention_pass)."""
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
    steps = cp - 1
    if rotate == "allgather":
        fwd = maximum(0.0, gather - block_f)
        bwd = maximum(0.0, maximum(gather, hop_dkv) - block_b) + maximum(0, steps - 1) * maximum(0.0, hop_dkv - block_b)
        forward_comm, gathers = gather, gather
    else:
        fwd = steps * maximum(0.0, hop_kv - block_f)
        bwd = steps * maximum(0.0, hop_kv + hop_dkv - block_b)
        forward_comm, gathers = steps * hop_kv, 0.0
    bwd = bwd + hop_dkv  # the accumulators' last hop home, after the last block
    rerun = layout.recompute != RecomputeMode.NONE
    bwd = bwd + where(rerun, fwd, 0.0)
    forwards = where(rerun, 2, 1)
    to_all = cp * hop_dkv + where(rotate == "allgather", 0.0, (forwards + 1) * forward_comm)
    gathered = (forwards + 1) * gathers
    on = cp > 1
    return RingTime(fwd_exposed_s=where(on, fwd, 0.0), bwd_exposed_s=where(on, bwd, 0.0),
                    comm_s=where(on, to_all + gathered, 0.0), all_gather_s=where(on, gathered, 0.0),
                    all_to_all_s=where(on, to_all, 0.0))
