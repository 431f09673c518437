"""The dense (single-rank) MoE dispatch when a capacity limit or grouped GEMMs are on: the expert-parallel one is
backend/strategies/moe_dispatch.py. Without either, `gpt.MoE.dispatch` keeps its per-expert loop.

- capacity only: the per-expert loop over the slots within capacity (a dropped slot reaches no expert);
- grouped GEMMs: every kept (token, slot) sorted by expert (stable), the rows gathered once, the experts run as one
  grouped GEMM per weight (models/grouped_experts.py), each row weighted by its router probability and index_add-ed
  into its token. Padding to capacity changes only the expert-parallel buffers: padded rows weigh 0, so the dense
  result is the same without them.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.models.grouped_experts import compute_dtype, grouped_reason, run_grouped


def sorted_slots(idx: torch.Tensor, keep: torch.Tensor | None, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order of the kept slots sorted by expert, rows per expert (E,)); dropped slots sort last and are cut."""
    expert = idx.reshape(-1)
    key = expert if keep is None else torch.where(keep.reshape(-1), expert, n_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts]
    return order[:int(counts.sum())], counts


def dense_dispatch(moe: Any, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, kept: Any) -> torch.Tensor:
    experts = list(moe.experts)
    keep = None if kept is None else kept.keep
    reason = grouped_reason(moe.spec.mlp, experts, compute_dtype(flat)) if moe.spec.moe_grouped_gemm else "off"
    moe.grouped_reason = reason
    if reason is None:
        k = idx.shape[1]
        order, counts = sorted_slots(idx, keep, moe.n_experts)
        for j in torch.nonzero(counts, as_tuple=True)[0].tolist():
            moe.mark_used(experts[j])
        tok = order // k
        y = run_grouped(moe.spec.mlp, experts, flat[tok], counts, zero_empty=moe.run_empty_experts)
        w = weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, tok, (y * w).to(flat.dtype))
    out = torch.zeros_like(flat)
    for e, expert in enumerate(experts):
        hit = idx == e if keep is None else (idx == e) & keep
        tok, slot = hit.nonzero(as_tuple=True)
        if tok.numel():
            moe.mark_used(expert)
        if not tok.numel() and not moe.run_empty_experts:
            continue
        out.index_add_(0, tok, (expert(flat[tok]) * weights[tok, slot].unsqueeze(-1)).to(out.dtype))
    return out
