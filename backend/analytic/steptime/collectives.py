"""Seconds of each collective: the α–β model per link tier (pure Python).

t = steps·α + wire_bytes / (B_link · efficiency), wire bytes from comm.ring_wire_bytes (ring algorithm);
ring steps: all-reduce 2(n-1), all-gather / reduce-scatter / all-to-all / broadcast (n-1), send 1
(Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
IJHPCA, Sec 4; Patarasuk & Yuan 2009). A group whose ranks sit on more than one node runs at the
inter-node tier (each GPU's own NIC is the ring's bottleneck link, Narayanan 2021 Sec 4.1).

Mesh order is (pp, dp, cp, tp), tp fastest (backend/spec/parallel_spec.py ParallelSpec.coords), ranks filled node by
node; the data-parallel group ("dp") is the dp x cp ranks, which are consecutive tp-strided ranks like the cp group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.ep_dispatch import Dispatch
from backend.analytic.scalar_or_array import logical_or, maximum, minimum, where
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.textbook.comm_volume import ring_wire_bytes

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec

INTRA, INTER = "intra", "inter"


def ring_steps(collective: str, n: int) -> int:
    """Latency terms of the ring algorithm (Thakur 2005 Sec 4)."""
    if n <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (n - 1)
    if collective in ("send", "recv"):
        return 1
    return n - 1


def group_stride(tp: Num, dp: Num, dim: str) -> Num:
    """Rank distance between neighbours of a mesh dimension (ints or per-layout arrays; dp = the dp x cp ranks); ep's
    depends on the stack (ep_dispatch.Dispatch.ep_stride)."""
    return {"tp": 1, "dp": tp, "cp": tp, "pp": tp * dp}[dim]


def dim_stride(spec: ExperimentSpec, dim: str) -> int:
    p = spec.parallel
    if dim == "ep":  # by the stack's expert mesh (ep_dispatch.py)
        return Dispatch.of_spec(spec).ep_stride(p.tp, p.etp)
    return group_stride(p.tp, p.dp_cp, dim)


def within_node(stride: Num, size: Num, dim: str, gpus_per_node: int) -> Num:
    """Every member of the group (stride · size consecutive ranks; pp: only neighbouring stages talk) fits in one
    node."""
    span = stride * (size if dim != "pp" else 2)
    return logical_or(size <= 1, span <= gpus_per_node)


def dim_tier(spec: ExperimentSpec, dim: str, size: int, gpus_per_node: int) -> str:
    """intra if every member of the group fits in one node."""
    return INTRA if within_node(dim_stride(spec, dim), size, dim, gpus_per_node) else INTER


def node_members(stride: Num, size: Num, gpus_per_node: int) -> Num:
    """Members of one group on the same node (stride < node size: node/stride of them, at most the group)."""
    return where(stride < gpus_per_node, maximum(1, minimum(size, gpus_per_node // stride)), 1)


def members_per_node(spec: ExperimentSpec, dim: str, size: int, gpus_per_node: int) -> int:
    return node_members(dim_stride(spec, dim), size, gpus_per_node)


def link_bandwidth(hw: Hardware, intra: Num, per_node: Num = 1) -> Num:
    """Effective bytes/s per rank inside a node, or across nodes: a group with k members per node drives k NICs
    (NCCL lays one ring channel per NIC), so the node boundary carries k·B_NIC, capped by the intra-node link
    (Jeaugey 2019, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA)."""
    t = hw.tune
    inside = hw.intra_bytes_per_s * t.intra_efficiency
    return where(intra, inside, minimum(inside, per_node * hw.inter_bytes_per_s * t.inter_efficiency))


def link(hw: Hardware, tier: str, per_node: int = 1) -> tuple[float, float]:
    """(effective bytes/s per rank, latency s per ring step) of a tier."""
    intra = tier == INTRA
    return link_bandwidth(hw, intra, per_node), hw.tune.intra_latency_s if intra else hw.tune.inter_latency_s


def bandwidth_s(hw: Hardware, intra: Num, collective: str, payload_bytes: Num, n: Num, per_node: Num = 1, *,
                link_bytes_per_s: Num | None = None) -> Num:
    """The bandwidth term of `collective_s`: ring wire bytes over the link (payloads and groups may be arrays;
    link_bytes_per_s: `link_bandwidth(hw, intra, per_node)` when the caller has it already)."""
    wire = ring_wire_bytes(collective, payload_bytes, n)
    bw = link_bandwidth(hw, intra, per_node) if link_bytes_per_s is None else link_bytes_per_s
    return wire / (bw * collective_efficiency(hw, collective))


def all_to_all_bandwidth_s(hw: Hardware, payload_bytes: Num, n: Num, on_node: Num) -> Num:
    """The bandwidth term of an all-to-all over n ranks, `on_node` of them on each node: every rank sends payload / n
    to each peer at once (NCCL's all-to-all is one grouped send / recv per peer), the on_node - 1 on its own node over
    the intra-node link and the n - on_node others through its own NIC; the slower path sets the time. One node
    (on_node = n) is the ring's (n - 1) / n at the intra-node tier, one member per node the same at the NIC's."""
    t = hw.tune
    inside = (on_node - 1) / n * payload_bytes / (hw.intra_bytes_per_s * t.intra_efficiency)
    across = (n - on_node) / n * payload_bytes / (hw.inter_bytes_per_s * t.inter_efficiency)
    return where(n > 1, maximum(inside, across), 0.0)


def all_to_all_s(hw: Hardware, tier: str, payload_bytes: float, n: int, on_node: int, calls: float = 1.0) -> float:
    """Seconds for `calls` all-to-alls moving `payload_bytes` in total over n ranks, `on_node` of them per node: the
    tier's latency per ring step, and the node-split bandwidth term (all_to_all_bandwidth_s)."""
    alpha = hw.tune.intra_latency_s if tier == INTRA else hw.tune.inter_latency_s
    return calls * ring_steps("all_to_all", n) * alpha + all_to_all_bandwidth_s(hw, payload_bytes, n, on_node)


def collective_s(hw: Hardware, tier: str, collective: str, payload_bytes: float, n: int, calls: float = 1.0,
                 per_node: int = 1) -> float:
    """Seconds for `calls` collectives moving `payload_bytes` in total over a group of n (α–β, module doc)."""
    if n <= 1 or payload_bytes <= 0:
        return 0.0
    alpha = hw.tune.intra_latency_s if tier == INTRA else hw.tune.inter_latency_s
    return calls * ring_steps(collective, n) * alpha + bandwidth_s(hw, tier == INTRA, collective, payload_bytes, n,
                                                                   per_node)


def collective_efficiency(hw: Hardware, collective: str) -> float:
    """Bandwidth of this collective relative to the tier's all-reduce-derived one. NCCL runs every ring collective at
    the same bus bandwidth (1.0); gloo on CPU runs reduce-scatter as an all-reduce of the whole buffer (≈2x the ring's
    wire bytes, backend/engine/accuracy_notes.py) and all-gather by its own algorithm, so hw_probe measures these or
    calibrate fits them."""
    t = hw.tune
    return {"all_gather": t.all_gather_efficiency, "reduce_scatter": t.reduce_scatter_efficiency}.get(collective, 1.0)
