"""Rows an expert-parallel MoE layer moves and computes per microbatch on its busiest rank: the capacity factor, padding
to capacity and the routing imbalance in one place (pure Python: activations, traffic, the step-time model and its
screen read it; moe_capacity.py has Megatron's capacity formula).

Uniform routing (the default, imbalance 1) gives every expert T k / E of a rank's T tokens' slots. An imbalance
rho >= 1 (`model.moe_imbalance`: the busiest rank's experts receive rho x the uniform load; a run measures its own,
measured/moe_routing.py) raises what the busiest rank receives; a capacity factor bounds it:
  dropless:          sent T k,              received rho T k
  capacity, no pad:  sent min(T k, E C),    received min(rho T k, E C)    (Megatron drops per expert above C)
  pad to capacity:   sent E P,              received E P                  (P = C, or T when C > T: static splits)
per rank with C = ceil(T k / E x factor) (moe_capacity.expert_capacity). The busiest rank's experts then run
received / (E / ep) rows each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.moe_capacity import expert_capacity, rows_per_expert_padded

if TYPE_CHECKING:
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class ExpertRows:
    sent: float
    """Rows this rank dispatches (its kept slots, padded rows included)."""
    received: float
    """Rows the busiest rank's local experts receive from the whole ep group."""
    kept: float
    """This rank's own slots within capacity (the combine's rows; = sent unless padded)."""


def expert_rows(*, tokens: int, top_k: int, n_experts: int, factor: float | None, pad: bool,
                imbalance: float = 1.0) -> ExpertRows:
    rows = tokens * top_k
    if factor is None:
        return ExpertRows(sent=rows, received=rows * imbalance, kept=rows)
    cap = expert_capacity(tokens, top_k, n_experts, factor)
    kept = rows if cap > tokens else min(rows, n_experts * cap)  # Megatron: no mask when the capacity exceeds T
    if pad:
        padded = n_experts * rows_per_expert_padded(tokens, top_k, n_experts, factor)
        return ExpertRows(sent=padded, received=padded, kept=min(kept, padded))
    if cap > tokens:
        return ExpertRows(sent=rows, received=rows * imbalance, kept=rows)
    return ExpertRows(sent=kept, received=min(rows * imbalance, n_experts * cap), kept=kept)


def of_model(model: ModelSpec, tokens: int) -> ExpertRows:
    """The rows of a ModelSpec's MoE (its capacity_factor, moe_pad_to_capacity, moe_imbalance) for `tokens` tokens."""
    return expert_rows(tokens=tokens, top_k=model.top_k, n_experts=max(model.n_experts, 1),
                       factor=getattr(model, "capacity_factor", None),
                       pad=bool(getattr(model, "moe_pad_to_capacity", False)),
                       imbalance=float(getattr(model, "moe_imbalance", 1.0)))


def moe_rows_key(model: ModelSpec) -> tuple[float | None, bool, float]:
    """The fields of_model reads beyond top_k and n_experts: a memo of anything computed from the rows keys on them."""
    return (getattr(model, "capacity_factor", None), bool(getattr(model, "moe_pad_to_capacity", False)),
            float(getattr(model, "moe_imbalance", 1.0)))


def is_uniform_dropless(model: ModelSpec) -> bool:
    """No capacity and uniform routing: every formula keeps its T k rows (the golden predictions)."""
    return getattr(model, "capacity_factor", None) is None and float(getattr(model, "moe_imbalance", 1.0)) == 1.0
