"""Training FLOPs of a ModelSpec, layer by layer (pure Python): textbook/flops.py's 6N + attention with each block's
own attention (the estimate, the step-time model's MFU and the run's assembled result all call this one function).

Weights: 6 x the matmul weights a token goes through (MoE: the router, top_k routed experts and the shared experts
of each MoE block, the dense MLP of each dense block: params.matmul_params(active=True)).
Attention, per block: QK^T over the keys a query is scored against (d_qk wide: MLA's nope + rope) and P.V (d_v
wide: MLA's v_head_dim), 2·a·s_kv·(d_qk + d_v) forward per token, PaLM App. B's 4·s·h when d_qk = d_v = h/a and
s_kv = s (no causal saving, the published convention). A windowed block scores s_kv = min(window, s) keys per query:
a sliding window (Beltagy et al. 2020, Longformer Sec 3.1: O(n·w)) or causal chunks of `window` tokens (Llama 4's
chunked attention: block-diagonal, s / c chunks of c x c); a global block s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.params import head_dim, layer_attention_kind, matmul_params, v_head_dim
from backend.analytic.textbook.flops import training_flops_per_token

if TYPE_CHECKING:
    from backend.spec import ModelSpec


def kv_lengths(m: ModelSpec) -> list[int]:
    """Keys scored per query in each block (window or the whole sequence)."""
    window = getattr(m, "window", None)
    return [min(window, m.seq_len) if layer_attention_kind(m, i)[1] else m.seq_len for i in range(m.n_layers)]


def attention_fwd_flops_per_token(m: ModelSpec) -> int:
    """Forward FLOPs of QK^T and P.V for one token, summed over the blocks."""
    return sum(2 * m.n_heads * s_kv * (head_dim(m) + v_head_dim(m)) for s_kv in kv_lengths(m))


def training_flops_per_step(m: ModelSpec, *, tokens: int, recompute: str = "none",
                            rerun: tuple[float, float] | None = None) -> float:
    """FLOPs per optimizer step (forward + backward [+ recompute]) of `tokens` tokens of model `m`; `rerun` as in
    textbook/flops.training_flops_per_token (recompute policies beyond none / selective / full)."""
    active = matmul_params(m, active=True) if m.is_moe else None
    return tokens * training_flops_per_token(n_params_dense=matmul_params(m), n_layers=m.n_layers, seq_len=m.seq_len,
                                             d_model=m.d_model, recompute=recompute, active_params=active,
                                             attention_fwd_per_token=attention_fwd_flops_per_token(m), rerun=rerun)
