"""Expert-parallel token dispatch/combine by all-to-all, hand-written because torch has no MoE layer.

Each MoE layer's experts are split over the ep ranks of an expert-parallel group: ep rank j owns the
contiguous experts [j·E/ep, (j+1)·E/ep). `MoE.dispatch(flat, weights, idx)` is replaced by:
  1. sort the N·k (token, slot) pairs by expert id (stable),
  2. exchange per-expert counts (one all_to_all of E int64 counts, not autograd),
  3. all_to_all the token rows to the ranks owning their experts (uneven splits, autograd:
     `_functional_collectives.all_to_all_single_autograd`),
  4. run the local experts on the rows they received,
  5. all_to_all the expert outputs back (the inverse splits),
  6. combine: weight each returned row by its router probability and index_add into its token.
Droppless (no capacity factor), so the result equals the dense `MoE.dispatch` up to float summation order.
Routing is data-dependent: a `RoutingLog` records, per call, the rows this rank sent to each expert and the
rows each ep peer sent to this rank's experts (the counts exchanged in step 2), for
backend/analytic/measured/moe_routing.py. Comm per MoE layer and microbatch: forward 8·E bytes (counts) + 2 all_to_alls
of N·k·C·4 bytes in total over the group, backward the same 2 all_to_alls again.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from backend.models.gpt import MoE
from backend.strategies import moe_sorted_dispatch
from backend.torch_compat import all_to_all_single_autograd


def shard_experts(moe: MoE, ep: int, ep_rank: int) -> list[int]:
    """Keep only this ep rank's experts, as a ModuleDict keyed by the GLOBAL expert id (stable param names)."""
    n_local = moe.n_experts // ep
    owned = list(range(ep_rank * n_local, (ep_rank + 1) * n_local))
    moe.experts = nn.ModuleDict({str(g): moe.experts[g] for g in owned})
    return owned


class RoutingLog:
    """Token counts of every dispatch since the last `start_step`, tagged with (microbatch, layer).

    A record: {"microbatch", "layer", "sent": [rows to expert e for e in 0..E-1],
    "received": [[rows from ep peer s to my local expert j for j in 0..E/ep-1] for s in 0..ep-1],
    "recompute": True when the same (microbatch, layer) already ran (activation checkpointing re-runs forward)}."""

    def __init__(self) -> None:
        self.start_step()

    def start_step(self) -> None:
        self.records: list[dict] = []
        self.microbatch = 0
        self._seen: set[tuple[int, str]] = set()

    def add(self, layer: str, counts: torch.Tensor, recv_counts: torch.Tensor, ep: int,
            routed: torch.Tensor | None = None, padded: int = 0) -> None:
        """routed: rows per expert before the capacity limit (only when one applies); padded: rows every expert
        takes from every rank under pad_to_capacity (the wire rows then: E x padded out, ep x E/ep x padded in)."""
        key = (self.microbatch, layer)
        record = {"microbatch": self.microbatch, "layer": layer, "sent": counts.tolist(),
                  "received": recv_counts.view(ep, -1).tolist(), "recompute": key in self._seen}
        if routed is not None:
            record["routed"] = routed.tolist()
        if padded:
            record["padded"] = padded
        self.records.append(record)
        self._seen.add(key)


def all_to_all_dispatch(moe: MoE, group: dist.ProcessGroup, ep: int, log: RoutingLog | None, layer: str,
                        flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, kept: Any = None) -> torch.Tensor:
    if kept is not None or moe.spec.moe_grouped_gemm:
        return moe_sorted_dispatch.sorted_dispatch(moe, group, ep, log, layer, flat, weights, idx, kept)
    N, C = flat.shape  # (N, C) tokens of this rank
    k, E = idx.shape[1], moe.n_experts
    n_local = E // ep
    expert = idx.reshape(-1)  # (N*k,) expert of each (token, slot)
    order = torch.argsort(expert, stable=True)
    tok = order // k  # token of each sorted slot
    counts = torch.bincount(expert, minlength=E)  # (E,)
    recv_counts = torch.empty_like(counts)  # (ep * n_local,): per source rank, its rows for my experts
    dist.all_to_all_single(recv_counts, counts, group=group)
    if log is not None:
        log.add(layer, counts, recv_counts, ep)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv_counts.view(ep, n_local).sum(1).tolist()
    x = all_to_all_single_autograd(flat[tok], recv_splits, send_splits, group)  # (R, C) rows for my experts
    local_ids = torch.arange(n_local, device=flat.device).repeat(ep)  # on the counts' device (NCCL: the GPU)
    local_expert = torch.repeat_interleave(local_ids, recv_counts)  # (R,)
    y = torch.zeros_like(x)
    for j, expert_mod in enumerate(moe.experts.values()):
        rows = (local_expert == j).nonzero(as_tuple=True)[0]
        if rows.numel():
            moe.mark_used(expert_mod)
            y = y.index_add(0, rows, expert_mod(x[rows]).to(y.dtype))  # autocast: 16-bit out, fp32 rows (as dense)
    if x.requires_grad and not y.requires_grad:
        # No local expert received a row: y would leave the autograd graph and this rank would skip both
        # backward all-to-alls its peers run (a hang). Keep it connected; the gradient sent back is zero.
        y = x * 0.0
    back = all_to_all_single_autograd(y, send_splits, recv_splits, group)  # (N*k, C) in sorted order
    w = weights.reshape(-1)[order].unsqueeze(-1)  # (N*k, 1)
    return torch.zeros_like(flat).index_add(0, tok, back * w)


def install(moe: MoE, group: dist.ProcessGroup, ep: int, ep_rank: int, log: RoutingLog | None = None,
            layer: str = "") -> list[int]:
    """Shard the experts of one MoE layer and swap in the all-to-all dispatch (recording its routing in `log`
    under the name `layer`); returns the owned expert ids."""
    owned = shard_experts(moe, ep, ep_rank)
    moe.dispatch = partial(all_to_all_dispatch, moe, group, ep, log, layer)
    return owned
