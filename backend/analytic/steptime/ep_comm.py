"""Seconds of one rank's expert-parallel dispatch and combine, by dispatcher (pure Python; one layout or arrays of
them): the step-time model (steptime/model.py) and the planner's screen (steptime/screen.py) both call
`dispatcher_bandwidth_s`, with the rows ep_dispatch.py says the stack sends.

- alltoall: the all-to-all's node split (collectives.all_to_all_bandwidth_s) over the ep group.
- allgather: a ring all-gather and a ring reduce-scatter of the gathered hidden states over the tp x ep group, each
  twice (forward and backward), at that group's tier.
- flex (DeepEP / HybridEP): the NVLink and the inter-node bytes of ep_dispatch.flex_rows, each link at its own
  bandwidth, the slower one setting the time, as for the all-to-all. DeepEP's own kernels reach a "logical" bandwidth
  above the NIC's (README @ dd758ca: 90 GB/s dispatch over CX7 at EP 8 x 2, local traffic counted); the links here
  are the hardware table's, as for NCCL, and the SMs the kernels take from the GEMMs are not counted.

Bandwidth only: model.py adds each collective's ring latency, the screen does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.ep_dispatch import Dispatch, allgather_bytes, dispatch_group, flex_rows
from backend.analytic.scalar_or_array import maximum, where
from backend.analytic.steptime.collectives import (
    all_to_all_bandwidth_s,
    bandwidth_s,
    link_bandwidth,
    node_members,
    within_node,
)

if TYPE_CHECKING:
    from backend.analytic.layout import Layout
    from backend.analytic.scalar_or_array import Num
    from backend.analytic.steptime.hardware import Hardware
    from backend.spec import ModelSpec


def dispatcher_bandwidth_s(model: ModelSpec, layout: Layout, hw: Hardware, gpus_per_node: int, *, payload: Num,
                           sent_tokens: Num, passes: Num) -> Num:
    """Bandwidth seconds of the EP dispatch and combine (forward and backward) of `passes` = microbatches x MoE blocks.
    payload: the alltoall dispatcher's bytes for them (ep_dispatch.all_to_all_payload_bytes x passes: every row,
    local ones included); sent_tokens: the tokens one rank dispatches per microbatch."""
    kind = str(model.moe_dispatcher)
    if kind == "alltoall":
        on_node = node_members(Dispatch.of_layout(layout).ep_stride(layout.tp, layout.etp), layout.ep, gpus_per_node)
        return where(layout.ep > 1, all_to_all_bandwidth_s(hw, payload, layout.ep, on_node), 0.0)
    group, stride = dispatch_group(layout)
    on_node = node_members(stride, group, gpus_per_node)
    if kind == "allgather":
        row_bytes = Dispatch.of_layout(layout).row_bytes(str(layout.precision))
        each = passes * allgather_bytes(model, sent_tokens, row_bytes, group)
        intra = within_node(stride, group, "ep", gpus_per_node)
        link = link_bandwidth(hw, intra, on_node)
        seconds = 2 * (bandwidth_s(hw, intra, "all_gather", each, group, link_bytes_per_s=link)
                       + bandwidth_s(hw, intra, "reduce_scatter", each, group, link_bytes_per_s=link))
        return where(layout.ep > 1, seconds, 0.0)
    inside_rows, across_rows = flex_rows(model, group, on_node, layout.etp)
    per_row = payload / model.top_k  # every row's bytes in the four transfers, as the all-to-all counts them
    t = hw.tune
    inside = inside_rows * per_row / (hw.intra_bytes_per_s * t.intra_efficiency)
    across = across_rows * per_row / (hw.inter_bytes_per_s * t.inter_efficiency)
    return where(layout.ep > 1, maximum(inside, across), 0.0)
