"""The router's capacity limit (token dropping) and load-balancing loss, as Megatron-Core applies them
(Megatron-LM core_v0.19.0, megatron/core/transformer/router.py `TopKRouter.routing` l. 741-832, moe_utils.py
`apply_router_token_dropping` l. 958-1023, `switch_load_balancing_loss_func` l. 56-143, `MoEAuxLossAutoScaler`
l. 284-334; the formulas in backend/analytic/moe_capacity.py).

- Drop: per rank on its own tokens, before dispatch: C = ceil(T k / E x capacity_factor); per expert the C routed
  slots of highest router probability stay (drop policy "probs"), the rest get weight 0 and are not dispatched.
  The single-process reference runs a dp rank's whole microbatch at once: `MoE.capacity_groups` then names, per
  sequence position, the cp rank that holds it, and the limit applies per group, exactly as on the ranks.
- Aux loss: coeff x E / (k T^2) x sum_i (sum_x p_xi) c_i over the routing before the drop (p: softmax scores, or
  sigmoid scores normalised per token; c_i: tokens routed to expert i). As in Megatron, c and T are summed over the
  sequence shards (cp here: one all_reduce of E counts; tp ranks here see every token of the microbatch). It is not
  part of the reported loss: `AuxLossScaler` hands its gradient to backward at the main loss's per-microbatch scale
  (`MoE.aux_loss_scale`, set by the step: 1/microbatches in the microbatch loop, 1 under a pipeline schedule, whose
  grads are divided afterwards, times an fp16 loss scale). Under cp each rank's share is multiplied by cp because
  ShardLab averages gradients over dp x cp where Megatron multiplies the loss by cp (its forward_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.analytic.moe_capacity import expert_capacity, rows_per_expert_padded


@dataclass
class Kept:
    """One MoE call's routing after the capacity limit."""
    keep: torch.Tensor
    """(N, k) bool: the slots within capacity (all True where nothing drops)."""
    padded_rows: int
    """Rows every expert takes from this rank under pad_to_capacity (0: no padding)."""
    dropped: torch.Tensor
    """0-dim int64: slots dropped in this call."""


def capacity_keep(weights: torch.Tensor, idx: torch.Tensor, n_experts: int, factor: float, pad: bool,
                  groups: torch.Tensor | None) -> Kept:
    """The slots kept per group of tokens (`groups`: a group id per token, None = one group)."""
    n, k = idx.shape
    keep = torch.ones_like(idx, dtype=torch.bool)
    probs = torch.zeros(n, n_experts, dtype=weights.dtype, device=weights.device).scatter(1, idx, weights.detach())
    members = [None] if groups is None else [torch.nonzero(groups == g, as_tuple=True)[0] for g in groups.unique()]
    padded = 0
    for rows in members:
        p = probs if rows is None else probs[rows]
        t = p.shape[0]
        cap = expert_capacity(t, k, n_experts, factor)
        padded = rows_per_expert_padded(t, k, n_experts, factor) if pad and groups is None else 0
        if cap > t:
            continue  # Megatron: no mask when the capacity exceeds the tokens
        top = torch.topk(p, k=cap, dim=0, sorted=False).indices  # (C, E): the C most probable tokens per expert
        mask = torch.zeros_like(p, dtype=torch.bool).scatter(0, top, True)
        sel = mask.gather(1, idx if rows is None else idx[rows])
        if rows is None:
            keep = sel
        else:
            keep[rows] = sel
    return Kept(keep=keep, padded_rows=padded, dropped=(~keep).sum())


def aux_scores(logits: torch.Tensor, scores: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """Megatron's compute_routing_scores_for_aux_loss: the softmax scores, or sigmoid scores normalised per token."""
    del logits
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if sigmoid else scores


def load_balancing_loss(scores: torch.Tensor, idx: torch.Tensor, n_experts: int, coeff: float,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """switch_load_balancing_loss_func over the routing before the drop; `group`: the sequence shards (cp)."""
    k = idx.shape[1]
    counts = torch.bincount(idx.reshape(-1), minlength=n_experts).to(scores.dtype)
    tokens, shards = scores.shape[0], 1
    if group is not None:
        dist.all_reduce(counts, group=group)
        shards = dist.get_world_size(group)
        tokens *= shards
    return (scores.sum(dim=0) * counts).sum() * (n_experts * coeff * shards / (k * tokens * tokens))


class AuxLossScaler(torch.autograd.Function):
    """Returns `activation` unchanged; in backward gives `aux` the gradient `scale` (MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None
