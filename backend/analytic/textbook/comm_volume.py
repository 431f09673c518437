"""Communication volumes per rank per step, in bytes (pure Python).

Payload S = bytes of the buffer handed to the collective (docs/ARCHITECTURE.md). Wire bytes = what a
bandwidth-optimal ring sends per rank: all-reduce 2(N-1)/N·S, all-gather / reduce-scatter /
all-to-all (N-1)/N·S (ring all-reduce = reduce-scatter + all-gather: ZeRO, Rajbhandari 2020 Sec 7.1;
Patarasuk & Yuan 2009). Element counts are turned into bytes by dtype_bytes, explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def ring_wire_bytes(collective: str, payload_bytes: Num, n: Num) -> Num:
    """Bytes one rank sends for a collective over n ranks with payload S (payload and n may be numpy arrays)."""
    collective = str(collective)
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} not in {COLLECTIVES}")
    if isinstance(n, int):
        if n < 1:
            raise ValueError(f"group size n must be >= 1, got {n}")
        if n == 1:
            return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n * payload_bytes  # ZeRO Sec 7.1: reduce-scatter + all-gather, Ψ(N-1)/N each
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload_bytes  # ring: each rank forwards N-1 of N chunks
    return payload_bytes * (n > 1) * 1.0  # broadcast (pipelined ring), send, recv: the whole buffer once


def dp_allreduce_wire_bytes(grad_bytes_total: float, n: int) -> float:
    """DDP gradient all-reduce: 2Ψ(N-1)/N (ZeRO paper, Rajbhandari 2020 Sec 7.1)."""
    return ring_wire_bytes("all_reduce", grad_bytes_total, n)  # ZeRO Sec 7.1


def zero12_wire_bytes(grad_bytes_total: float, n: int) -> float:
    """ZeRO-1/2: reduce-scatter grads + all-gather params = 2Ψ(N-1)/N, same as DDP (ZeRO Sec 7.2.1)."""
    return 2 * ring_wire_bytes("reduce_scatter", grad_bytes_total, n)  # ZeRO Sec 7.2.1


def zero3_wire_bytes(param_bytes_total: float, n: int) -> float:
    """ZeRO-3 / FSDP: all-gather fwd + all-gather bwd + reduce-scatter grads = 3Ψ(N-1)/N (ZeRO Sec 7.2.2)."""
    return 3 * ring_wire_bytes("all_gather", param_bytes_total, n)  # ZeRO Sec 7.2.2: 1.5x DDP


def tp_layer_allreduce_payload_bytes(*, b: int, s: int, h: int, dtype_bytes: float) -> float:
    """Payload of one TP all-reduce: the (b, s, h) activation, b·s·h elements · dtype_bytes (Shoeybi 2019 Sec 3)."""
    return b * s * h * dtype_bytes


def tp_layer_wire_bytes(*, b: int, s: int, h: int, t: int, dtype_bytes: float) -> float:
    """Per transformer layer per microbatch: 4 all-reduces (2 fwd + 2 bwd) of b·s·h elements,
    i.e. 8·b·s·h·(t-1)/t elements on the wire (Narayanan 2021 Sec 3.2); bytes = elements · dtype_bytes.
    With sequence parallelism the all-reduces become all-gather + reduce-scatter pairs: same wire bytes
    (Korthikanti 2022 Sec 4.2.2)."""
    payload = tp_layer_allreduce_payload_bytes(b=b, s=s, h=h, dtype_bytes=dtype_bytes)
    return 4 * ring_wire_bytes("all_reduce", payload, t)  # Narayanan 2021 Sec 3.2: 2 fwd + 2 bwd all-reduces


def pp_p2p_bytes(*, b: int, s: int, h: int, dtype_bytes: float) -> float:
    """One microbatch crossing one stage boundary in one direction: b·s·h elements (Narayanan 2021 Sec 3.2)."""
    return b * s * h * dtype_bytes  # activations forward, same-size gradients backward


def pp_stage_p2p_bytes_per_step(*, b: int, s: int, h: int, dtype_bytes: float, m: int, stage: int, p: int,
                                v: int = 1) -> float:
    """Bytes a rank sends per step: m microbatches forward (unless last stage) + m backward (unless first),
    for each of its v chunks (interleaving multiplies p2p traffic by v, Narayanan 2021 Sec 2.2.2)."""
    one = pp_p2p_bytes(b=b, s=s, h=h, dtype_bytes=dtype_bytes)
    if v == 1:
        sends = (stage < p - 1) + (stage > 0)
        return m * sends * one
    # with v chunks only the very first and very last chunk boundaries are absent
    sends = 2 * v - (stage == 0) - (stage == p - 1)
    return m * sends * one


def ep_all_to_all_payload_bytes(*, tokens: int, h: int, top_k: int, dtype_bytes: float) -> float:
    """Per MoE layer per step: dispatch + combine in forward and both again in backward = 4 all-to-alls,
    each moving tokens·top_k rows of h elements (Lepikhin et al. 2021, GShard Sec 3.1, Algorithm 2: dispatch and
    combine einsums realised as AllToAll). Uniform routing; payload counts every row, local ones included."""
    return 4 * tokens * top_k * h * dtype_bytes  # GShard Alg. 2: 4 = (dispatch + combine) x (fwd + bwd)


def ep_all_to_all_wire_bytes(*, tokens: int, h: int, top_k: int, dtype_bytes: float, ep: int) -> float:
    """Ring wire bytes for the 4 EP all-to-alls (uniform routing assumed)."""
    payload = ep_all_to_all_payload_bytes(tokens=tokens, h=h, top_k=top_k, dtype_bytes=dtype_bytes)
    return ring_wire_bytes("all_to_all", payload, ep)
