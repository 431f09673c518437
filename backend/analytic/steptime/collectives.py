"""Seconds of each collective: the α–β model per link tier (pure Python).

t = steps·α + wire_bytes / (B_link · efficiency), wire bytes from comm.ring_wire_bytes (ring algorithm);
ring steps: all-reduce 2(n-1), all-gather / reduce-scatter / all-to-all / broadcast (n-1), send 1
(Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
IJHPCA, Sec 4; Patarasuk & Yuan 2009). A group whose ranks sit on more than one node runs at the
inter-node tier (each GPU's own NIC is the ring's bottleneck link, Narayanan 2021 Sec 4.1).

Mesh order is (pp, dp, tp), tp fastest (backend/spec.py ParallelSpec.coords), ranks filled node by node.
"""

from __future__ import annotations

from typing import Any

from backend.analytic.textbook import comm as C
from backend.analytic.steptime.hardware import Hardware

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


def dim_stride(spec: Any, dim: str) -> int:
    """Rank distance between neighbours of a mesh dimension."""
    p = spec.parallel
    return {"tp": 1, "dp": p.tp, "ep": p.tp, "pp": p.tp * (p.dp or 1)}[dim]


def dim_tier(spec: Any, dim: str, size: int, gpus_per_node: int) -> str:
    """intra if every member of the group (stride · size consecutive ranks) fits in one node."""
    if size <= 1:
        return INTRA
    span = dim_stride(spec, dim) * (size if dim != "pp" else 2)  # pp: only neighbouring stages talk
    return INTRA if span <= gpus_per_node else INTER


def members_per_node(spec: Any, dim: str, size: int, gpus_per_node: int) -> int:
    """Members of one group on the same node (stride < node size: node/stride of them, at most the group)."""
    stride = dim_stride(spec, dim)
    return max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1


def link(hw: Hardware, tier: str, per_node: int = 1) -> tuple[float, float]:
    """(effective bytes/s per rank, latency s per ring step) of a tier. Across nodes, a group with k members
    per node drives k NICs: NCCL lays one ring channel per NIC, so the node boundary carries k·B_NIC, capped by
    the intra-node link (Jeaugey 2019, "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA)."""
    t = hw.tune
    intra = hw.intra_bytes_per_s * t.intra_efficiency
    if tier == INTRA:
        return intra, t.intra_latency_s
    return min(intra, per_node * hw.inter_bytes_per_s * t.inter_efficiency), t.inter_latency_s


def collective_s(hw: Hardware, tier: str, collective: str, payload_bytes: float, n: int, calls: float = 1.0,
                 per_node: int = 1) -> float:
    """Seconds for `calls` collectives moving `payload_bytes` in total over a group of n (α–β, module doc)."""
    if n <= 1 or payload_bytes <= 0:
        return 0.0
    bw, alpha = link(hw, tier, per_node)
    wire = C.ring_wire_bytes(collective, payload_bytes, n)
    return calls * ring_steps(collective, n) * alpha + wire / (bw * collective_efficiency(hw, collective))


def collective_efficiency(hw: Hardware, collective: str) -> float:
    """Bandwidth of this collective relative to the tier's all-reduce-derived one. NCCL runs every ring collective at
    the same bus bandwidth (1.0); gloo on CPU runs reduce-scatter as an all-reduce of the whole buffer (≈2x the ring's
    wire bytes, backend/engine/notes.py) and all-gather by its own algorithm, so hw_probe measures these or calibrate fits them."""
    t = hw.tune
    return {"all_gather": t.all_gather_efficiency, "reduce_scatter": t.reduce_scatter_efficiency}.get(collective, 1.0)
