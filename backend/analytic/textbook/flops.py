"""Training FLOPs and the Megatron parameter count (pure Python).

Per token, fwd+bwd: 6N (matmuls with weights) + 12·L·s·h (attention scores and weighted sum,
no causal saving) — Narayanan et al. 2021 Sec 5.1 Eq. 3 / Chowdhery et al. 2022 (PaLM) Appendix B.
Kaplan et al. 2020 Sec 2.1 counts the forward only (2N + 2·L·s·d_attn): a smaller attention term.
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def narayanan_param_count(*, l: int, h: int, V: int, s: int) -> float:  # noqa: E741 - the paper's symbol, a keyword
    """P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12lh)) (Narayanan 2021 Sec 5.1, Eq. 2)."""
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))  # Narayanan 2021 Eq. 2


def training_flops_per_token(*, n_params_dense: float, n_layers: int, seq_len: int, d_model: int,
                             recompute: str = "none", active_params: float | None = None,
                             attention_fwd_per_token: float | None = None,
                             rerun: tuple[float, float] | None = None) -> float:
    """FLOPs to train on one token (forward + backward [+ recompute]).

    `active_params` (MoE: params a token actually touches, top_k experts) replaces n_params_dense.
    `attention_fwd_per_token` (the forward QK^T + P.V FLOPs of a token over all layers; backward is twice that)
    replaces PaLM's 4·L·s·h forward when the blocks' attention differs from it (windows, own head widths, MLA).
    Full recompute re-runs the forward of all N (8N): slightly high since the LM head is not recomputed.
    `rerun` = (share of the weight FLOPs, share of the attention FLOPs) re-run in backward, for the policies beyond
    none / selective / full (analytic/recompute_cost.py); it replaces `recompute`.
    """
    n = n_params_dense if active_params is None else active_params
    weights = 6 * n  # Kaplan 2020 Sec 2.1: 2N forward, 4N backward
    attn_fwd = 4 * n_layers * seq_len * d_model if attention_fwd_per_token is None else attention_fwd_per_token
    attn = 3 * attn_fwd  # PaLM App. B: 12·L·H·Q·T; Narayanan Eq. 3 s/(6h) term
    if rerun is not None:
        return weights + 2 * n * rerun[0] + attn + attn_fwd * rerun[1]
    recompute = str(recompute)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} not in {RECOMPUTE}")
    if recompute == "full":
        weights += 2 * n  # Narayanan 2021 Eq. 3: 4 passes (96 B s l h²) instead of 3 (72 B s l h²)
        attn += attn_fwd
    elif recompute == "selective":
        attn += attn_fwd  # Korthikanti 2022 Sec 5: only QK^T and softmax·V are recomputed
    return weights + attn


def training_flops_per_step(*, n_params_dense: float, tokens: float, n_layers: int, seq_len: int,
                            d_model: int, recompute: str = "none", active_params: float | None = None,
                            rerun: tuple[float, float] | None = None) -> float:
    """FLOPs per optimizer step = per-token FLOPs · tokens (tokens = global batch · seq_len)."""
    return tokens * training_flops_per_token(n_params_dense=n_params_dense, n_layers=n_layers, seq_len=seq_len,
                                             d_model=d_model, recompute=recompute, active_params=active_params,
                                             rerun=rerun)


def narayanan_flops_per_iteration(*, B: int, s: int, l: int, h: int, V: int,  # noqa: E741 - the paper's symbols
                                  recompute: bool = True) -> float:
    """96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with full recompute (Narayanan 2021 Eq. 3); 72·... without."""
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))  # Narayanan 2021 Eq. 3
    # Narayanan 2021 Eq. 3 derivation with 3 passes, not 4
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_flops_per_iteration(*, batch: int, seq: int, layers: int, hidden: int, heads: int, kv_heads: int,
                                 ffn: int, vocab: int, gated: bool) -> float:
    """The FLOPs Megatron-LM's throughput line counts per iteration (megatron/training/training.py
    num_floating_point_operations, dense non-MLA branch): 12·B·s·L·h²·((1 + g/a + s/h)·(q/h) + (f/h)·(3/2 if
    gated) + V/(2·L·h)), with q = h (query projection = heads x head dim); no recompute counted."""
    gated_multiplier = 3 / 2 if gated else 1
    return (12 * batch * seq * layers * hidden * hidden
            * ((1 + kv_heads / heads + seq / hidden) + (ffn / hidden) * gated_multiplier
               + vocab / (2 * layers * hidden)))
