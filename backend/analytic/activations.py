"""Activation bytes saved for backward (pure Python).

Two models:
- `korthikanti_layer_bytes`: the published per-layer formulas (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec 4 / Table 2): 16-bit activations, with
  dropout, GPT-style layer with 4h MLP.
- `model_layer_activation_bytes` / `model_embedding_head_activation_bytes`: what autograd saves for
  OUR model (backend/models/gpt.py), read off the ops it runs (no dropout, explicit softmax attention).
Symbols: s sequence, b microbatch, h hidden, a heads, t tensor-parallel degree, sp sequence parallel.
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")
INDEX_BYTES = 8  # int64 indices (topk, nonzero) that autograd saves for index ops
STAT_BYTES = 4  # LayerNorm mean/rstd are fp32


def _check_recompute(recompute: str) -> str:
    recompute = str(recompute)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} not in {RECOMPUTE}")
    return recompute


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer, Korthikanti 2022 Table 2."""
    recompute = _check_recompute(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)  # Table 2 "full recompute": 2sbh input per layer (/t with SP)
    attn_scores = 0.0 if recompute == "selective" else 5 * a * s / h  # Sec 5: selective recompute drops the 5as/h term
    if sp:
        return sbh / t * (34 + attn_scores)  # Table 2: sbh/t (34 + 5as/h); selective sbh·34/t
    return sbh * (10 + 24 / t + attn_scores / t)  # Table 2: sbh(10 + 24/t + 5as/(ht)); selective sbh(10 + 24/t)


def _attn_core_elems(*, s, b, h, a, t) -> float:
    # matmul copies of q, k^T (GQA: repeat_interleave'd, so always a·d_head = h wide) saved by bmm: 2sbh/t;
    # softmax output probs (b, a, s, s) saved by softmax and probs@v: a·s²·b/t; v copy saved by bmm: sbh/t
    return (3 * s * b * h + a * s * s * b) / t


def _mlp_elems(*, s, b, h, ffn, t) -> float:
    # fc_in saves its input (ln2 output; counted in the block), GELU saves fc_in output (s·b·ffn),
    # fc_out saves GELU output (s·b·ffn)
    return 2 * s * b * ffn / t


def _moe_bytes(*, s, b, h, ffn, n_experts, top_k, dtype_bytes) -> float:
    n = s * b  # tokens
    rows = n * top_k  # (token, expert) pairs; all tokens reach their k experts (no capacity drop)
    elems = n * n_experts  # router softmax output (N, E), saved by softmax
    elems += rows + n  # normalised top-k weights: div saves the topk values (N, k) and their sum (N, 1)
    elems += rows * h  # each expert's fc_in saves its gathered input flat[tok]
    elems += 2 * rows * ffn  # GELU input and fc_out input inside the experts
    elems += rows * h + rows  # mul(expert_out, w) saves both operands
    elems += rows * h  # index_add_(0, tok, weighted) keeps its source (expert_out · w)
    index = rows + 2 * rows  # topk indices; nonzero (tok, slot) pairs per expert
    return elems * dtype_bytes + index * INDEX_BYTES


def model_layer_activation_bytes(*, s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, dtype_bytes: float,
                                 t: int = 1, sp: bool = False, recompute: str = "none", n_experts: int = 0,
                                 top_k: int = 1) -> float:
    """Bytes autograd holds for backward for ONE block of backend.models.gpt (pre-LN, no dropout).

    Terms (elements, then · dtype_bytes):
      ln1 input x (sbh), ln1 stats mean+rstd (2sb fp32), ln1 output = q/k/v Linear input (sbh),
      attention core (q, k, v copies 3sbh + probs a s² b), causal mask (s² bool), o Linear input (sbh),
      ln2 input (sbh), ln2 stats (2sb fp32), ln2 output = fc_in input (sbh), MLP 2·s·b·ffn (or MoE).
    kv_heads does not change the bytes: GQA k/v are repeat_interleave'd to a heads before the matmuls
    and only the repeated copies are saved.
    TP (t > 1): head- and ffn-split tensors divide by t; the norms and their outputs stay replicated;
    with SP the norm inputs and stats divide by t but the all-gathered Linear inputs stay full.
    Selective recompute (checkpointed core attention) keeps q, k, v (3sbh/t) instead of the core.
    Full recompute keeps only the block input (sbh, /t with SP); one block is recomputed at a time.
    """
    recompute = _check_recompute(recompute)
    del kv_heads  # see docstring: saved k/v are always a·d_head wide
    sb, sbh = s * b, s * b * h
    norm_div = t if sp else 1
    if recompute == "full":
        return sbh / norm_div * dtype_bytes  # checkpoint(layer, h) saves the layer input only
    elems = 2 * sbh / norm_div  # ln1 and ln2 inputs (the residual stream)
    stat_bytes = 2 * 2 * sb / norm_div * STAT_BYTES  # mean and rstd for two LayerNorms
    elems += 2 * sbh  # ln1 / ln2 outputs as the Linear inputs (all-gathered to full size under SP)
    elems += sbh / t  # o Linear input (heads merged back, B, T, h/t)
    mask_bytes = 0.0
    if recompute == "selective":
        elems += 3 * sbh / t  # checkpoint keeps q, k, v (linear outputs or GQA-repeated copies)
    else:
        elems += _attn_core_elems(s=s, b=b, h=h, a=a, t=t)
        mask_bytes = s * s  # masked_fill saves the (s, s) bool mask
    if n_experts:
        moe = _moe_bytes(s=s, b=b, h=h, ffn=ffn, n_experts=n_experts, top_k=top_k, dtype_bytes=dtype_bytes)
        return elems * dtype_bytes + stat_bytes + mask_bytes + moe
    elems += _mlp_elems(s=s, b=b, h=h, ffn=ffn, t=t)
    return elems * dtype_bytes + stat_bytes + mask_bytes


def model_full_recompute_peak_extra_bytes(**layer_kwargs) -> float:
    """Extra bytes while one checkpointed block is recomputed in backward: a whole block's activations."""
    kw = dict(layer_kwargs, recompute="none")
    return model_layer_activation_bytes(**kw)


def model_embedding_head_activation_bytes(*, s: int, b: int, h: int, vocab: int, dtype_bytes: float, t: int = 1,
                                          sp: bool = False, logits_held: bool = True,
                                          loss_parallel: bool = False) -> float:
    """Bytes saved outside the blocks on the stages that own embedding / head, end of forward.

    Embedding: the token-embedding backward needs only the indices (the input batch); pos = arange(s)
    int64 is created in forward. Head: final LayerNorm input (sbh) + stats (2sb fp32), lm_head input
    (sbh), cross-entropy log_softmax output (s·b·V, fp32 because loss_fn calls .float()), plus the
    logits themselves while the caller holds them (s·b·V·dtype_bytes) and, for 16-bit logits, nothing
    more (the fp32 copy is only an input of log_softmax, which saves its output).
    With SP the final norm's input and stats are split over t (the lm_head input is all-gathered, full);
    with loss_parallel the vocab dimension of logits and log-probs is split over t.
    """
    v_div = t if loss_parallel else 1
    emb = s * INDEX_BYTES  # pos = arange(s) (int64)
    loss = 2 * 4  # nll_loss saves total_weight; the loss scalar itself
    norm_div = t if sp else 1
    head = s * b * h * dtype_bytes * (1 + 1 / norm_div) + 2 * s * b / norm_div * STAT_BYTES  # lm_head in, norm in, stats
    head += s * b * vocab / v_div * 4  # log_softmax output, fp32
    if logits_held:
        head += s * b * vocab / v_div * dtype_bytes
    return emb + head + loss


def model_backward_head_transient_bytes(*, s: int, b: int, vocab: int, dtype_bytes: float, t: int = 1,
                                        loss_parallel: bool = False) -> float:
    """Temporaries at the start of backward on the last stage, on top of the saved activations:
    the grad of the fp32 log-probs (s·b·V·4) and the grad of the logits (s·b·V·dtype_bytes; for 16-bit
    logits the fp32 grad of the .float() copy exists too). Dominates the backward peak when V >> h."""
    v_div = t if loss_parallel else 1
    extra = 0 if dtype_bytes == 4 else s * b * vocab / v_div * 4  # fp32 grad before the cast back
    return s * b * vocab / v_div * (4 + dtype_bytes) + extra
