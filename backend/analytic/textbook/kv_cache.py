"""KV-cache bytes for autoregressive inference (pure Python).

Source: Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention" (vLLM), Sec 3
(KV cache = 2 · batch · context · layers · kv_heads · head_dim values; 800 KB/token for OPT-13B);
Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec 2 (multiquery attention shrinks n_kv).
"""

from __future__ import annotations


def kv_cache_bytes(*, batch: int, context: int, n_layers: int, n_kv_heads: int, head_dim: int,
                   dtype_bytes: float, tp: int = 1) -> float:
    """Per-rank KV-cache bytes; TP splits KV heads across ranks (replicated when n_kv_heads < tp)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    # Megatron TP: heads split, else each rank keeps one replica
    heads_per_rank = n_kv_heads / tp if n_kv_heads >= tp else 1
    # vLLM Sec 3: K and V per token per layer
    return 2 * batch * context * n_layers * heads_per_rank * head_dim * dtype_bytes


def kv_cache_bytes_per_token(*, n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """One token's K and V across all layers (vLLM, Kwon 2023 Sec 3)."""
    return kv_cache_bytes(batch=1, context=1, n_layers=n_layers, n_kv_heads=n_kv_heads,
                          head_dim=head_dim, dtype_bytes=dtype_bytes)
