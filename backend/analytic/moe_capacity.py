"""Expert capacity and dropped tokens as Megatron-Core computes them (pure Python: the engine's router, the memory and
traffic model and the measured-routing check share these).

Megatron-LM core_v0.19.0 (5be96267), megatron/core/transformer/moe/moe_utils.py:
- `get_capacity(num_tokens, num_experts, capacity_factor)` (l. 241-259) = ceil(num_tokens / num_experts x factor),
  called by `apply_router_token_dropping` (l. 958-1023) with num_tokens = T x top_k: C = ceil(T k / E x factor);
- no drop when C > T (`if expert_capacity > num_tokens`), else per expert the C routed slots of highest probability
  stay (drop policy "probs", the default), so a rank drops sum_e max(0, c_e - C) slots of its T tokens;
- with pad_to_capacity every expert takes exactly C rows (all T when C > T: the capacity mask is then all ones).
The drop is per rank on its own tokens (T = the tokens entering the MoE layer on that rank, one microbatch), before
dispatch; the load-balancing loss is computed from the routing before the drop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def expert_capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """C: the most routed slots of `tokens` tokens one expert keeps (Megatron's get_capacity(T k, E, factor))."""
    return math.ceil((tokens * top_k / n_experts) * factor)


def drops(tokens: int, top_k: int, n_experts: int, factor: float | None) -> bool:
    """Whether the capacity limit can drop anything (Megatron skips the mask when C > T)."""
    return factor is not None and expert_capacity(tokens, top_k, n_experts, factor) <= tokens


def rows_per_expert_padded(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Rows every expert takes from one rank under pad_to_capacity: C, or all T tokens when C > T."""
    return min(expert_capacity(tokens, top_k, n_experts, factor), tokens)


def dropped_slots(counts: Iterable[int], *, tokens: int, top_k: int, factor: float | None) -> int:
    """Slots a rank drops for routed counts c_e (its tokens' slots per expert, before the drop): sum max(0, c_e - C)."""
    counts = list(counts)
    if not drops(tokens, top_k, len(counts), factor):
        return 0
    cap = expert_capacity(tokens, top_k, len(counts), factor)
    return sum(max(0, int(c) - cap) for c in counts)


def sent_rows(*, tokens: int, top_k: int, n_experts: int, factor: float | None, pad: bool,
              uniform_counts: bool = True) -> float:
    """Rows one rank dispatches per MoE layer and microbatch under uniform routing (c_e = T k / E): T k dropless or
    when nothing exceeds C, E x C padded (E x T when C > T), sum_e min(c_e, C) otherwise."""
    del uniform_counts  # uniform routing: c_e = T k / E <= C whenever factor >= 1
    rows = tokens * top_k
    if factor is None:
        return rows
    if pad:
        return n_experts * rows_per_expert_padded(tokens, top_k, n_experts, factor)
    if not drops(tokens, top_k, n_experts, factor):
        return rows
    return n_experts * min(rows / n_experts, expert_capacity(tokens, top_k, n_experts, factor))
