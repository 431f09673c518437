"""The expert-parallel all-to-all dispatch with a capacity limit, padding to capacity or grouped GEMMs (the dropless
per-expert-loop dispatch stays in moe_dispatch.py, unchanged).

Megatron-Core's MoEAlltoAllTokenDispatcher (token_dispatcher.py @ core_v0.19.0 l. 372-867) in the order it runs:
  1. the router already dropped the slots over capacity (models/moe_capacity.py); the kept slots are sorted by
     expert (stable: `permute`), dropped ones cut;
  2. the E int64 counts of REAL rows per expert go out first (one all_to_all, as before; Megatron all-gathers them);
  3. pad_to_capacity: every expert gets exactly P rows from every rank (P = C, or T when C > T), the real ones first
     and zero rows after them, so the split sizes are static (`drop_and_pad`: no count is needed to size them);
  4. all_to_all of the rows (autograd), the local experts run on what arrived: grouped by local expert as one
     grouped GEMM per weight (models/grouped_experts.py; `sort_chunks_by_idxs` in Megatron) or the per-expert loop;
  5. the inverse all_to_all, the padding rows cut, each real row weighted by its router probability and index_add-ed
     into its token.
Padding rows weigh 0 and carry no gradient to the router; their expert gradients are 0 too. An expert counts as used
(step.ExpertUsage) only when real rows reached it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from backend.models.grouped_experts import compute_dtype, grouped_reason, run_grouped
from backend.models.moe_sorted import sorted_slots
from backend.torch_compat import all_to_all_single_autograd


def padded_positions(counts: torch.Tensor, per_expert: int) -> torch.Tensor:
    """Where each sorted real row sits in the padded buffer: expert e's j-th row at e x per_expert + j."""
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    return torch.arange(int(counts.sum()), device=counts.device) - starts[expert] + expert * per_expert


def run_local_experts(moe: Any, x: torch.Tensor, rows_per: torch.Tensor, real_per: torch.Tensor,
                      ep: int) -> torch.Tensor:
    """The local experts on the rows x that arrived (rows_per[s * n_local + j] from peer s for local expert j)."""
    experts = list(moe.experts.values())
    n_local = len(experts)
    for j, used in enumerate((real_per.view(ep, n_local).sum(0) > 0).tolist()):
        if used:
            moe.mark_used(experts[j])
    local_ids = torch.arange(n_local, device=x.device).repeat(ep)
    local_expert = torch.repeat_interleave(local_ids, rows_per)  # (R,)
    reason = grouped_reason(moe.spec.mlp, experts, compute_dtype(x)) if moe.spec.moe_grouped_gemm else "off"
    moe.grouped_reason = reason
    if reason is None:
        perm = torch.argsort(local_expert, stable=True)
        y = run_grouped(moe.spec.mlp, experts, x[perm], rows_per.view(ep, n_local).sum(0))
        return y[torch.argsort(perm)].to(x.dtype)
    y = torch.zeros_like(x)
    for j, expert_mod in enumerate(experts):
        rows = (local_expert == j).nonzero(as_tuple=True)[0]
        if rows.numel():
            y = y.index_add(0, rows, expert_mod(x[rows]).to(y.dtype))
    return y


def sorted_dispatch(moe: Any, group: dist.ProcessGroup, ep: int, log: Any, layer: str, flat: torch.Tensor,
                    weights: torch.Tensor, idx: torch.Tensor, kept: Any) -> torch.Tensor:
    k, E = idx.shape[1], moe.n_experts
    n_local = E // ep
    order, counts = sorted_slots(idx, None if kept is None else kept.keep, E)
    tok = order // k
    per = kept.padded_rows if kept is not None else 0
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    if log is not None:
        routed = torch.bincount(idx.reshape(-1), minlength=E) if kept is not None else None
        log.add(layer, counts, recv_counts, ep, routed=routed, padded=per)
    if per:
        pos = padded_positions(counts, per)
        send = flat.new_zeros(E * per, flat.shape[1]).index_add(0, pos, flat[tok])
        send_splits = [n_local * per] * ep
        recv_splits = send_splits
        rows_per = torch.full_like(recv_counts, per)
    else:
        send = flat[tok]
        send_splits = counts.view(ep, n_local).sum(1).tolist()
        recv_splits = recv_counts.view(ep, n_local).sum(1).tolist()
        rows_per = recv_counts
    x = all_to_all_single_autograd(send, recv_splits, send_splits, group)
    y = run_local_experts(moe, x, rows_per, recv_counts, ep)
    if x.requires_grad and not y.requires_grad:
        y = x * 0.0  # no local row: stay in the graph so the backward all_to_alls still run (moe_dispatch.py)
    back = all_to_all_single_autograd(y, send_splits, recv_splits, group)
    if per:
        back = back[pos]
    w = weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(flat).index_add(0, tok, back * w)
