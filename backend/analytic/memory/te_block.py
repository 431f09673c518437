"""Saved bytes of one Megatron-Core + Transformer Engine block (one microbatch, one rank), by part, and what
Megatron's `--recompute-modules` frees of each (issue 34). Pure Python; read from the sources, not measured here.

Sources: Megatron-LM d98e8a64 (`megatron/core/...`) and TransformerEngine d0067d0 (`transformer_engine/pytorch/...`).
Symbols per block: s b the tokens of one microbatch on this cp rank, t = tp, t_sp = t under sequence parallelism, c the
16-bit compute bytes, N = s b / t_sp the tokens a rank's norms, router and experts see.

- Standard attention (TELayerNormColumnParallelLinear qkv, FusedAttention, row-parallel proj): the norm's input and
  output (c B each; the output 1 B under fp8) and rsigma (LayerNorm also mu) per token / t_sp; Q, K, V, O (c B) and
  an fp8 copy of O per head-split element / t; fp32 softmax stats 4 a / t. TE `_LayerNormLinear.forward`
  (module/layernorm_linear.py 526-536), `FusedAttnFunc` (attention/dot_product_attention/backends.py 1590-1664),
  `_Linear` (module/linear.py 594-621). Unfused core attention (attention_kernel eager: Megatron-Core
  `DotProductAttention`, transformer/dot_product_attention.py 194-239, the 2022 papers' code): baddbmm of Q and K,
  `FusedScaleMaskSoftmax` saving its output (fusions/fused_softmax.py 36, 86, 132: c B per score, a s per token / t),
  bmm of those probabilities with V; no dropout mask (attention_dropout 0 in the recipes; Korthikanti's Table 2 counts
  one, 1 B per score, and two hidden-dropout masks, 2 sbh).
- Multi-latent attention (`MLASelfAttention`, transformer/multi_latent_attention.py; gpt_layer_specs.py 246-307): a
  standalone input RMSNorm saves x and rstd; both duplicated down projections save its output (one c B tensor; under
  fp8 each its own 1 B column-wise copy); q_up / kv_up (TELayerNormColumnParallelLinear) save q_compressed,
  kv_compressed, their norm outputs (1 B under fp8) and rsigma per token / t_sp; FusedAttention saves q, k (a x
  (nope + rope)), v, O (a x v_head) / t and the stats.
- Dense MLP (TELayerNormColumnParallelLinear fc1, fused bias-SwiGLU, TERowParallelLinear fc2; gpt_layer_specs.py
  534-552): the norm's input, output and stats / t_sp; fc1's output g f / t (c B) and fc2's input f / t (1 B fp8).
- MoE MLP (alltoall dispatcher, TEGroupedMLP; transformer/moe/): a standalone pre-MLP norm's input, output and rstd
  per N; the router's top-k (8 k) and probabilities (softmax 4 k; sigmoid 4 E + 4 k + 4: moe_utils.py 879-929);
  the unfused permutation's pinned argsort (8 E) and sort order (8 k) (moe_utils.py 473-486); per received row R the
  grouped fc1 input h, SwiGLU input 2 f and fc2 input f (c B; fc1 / fc2 inputs 1 B under fp8), its prob (c B)
  (experts.py 840-1047, fused_bias_swiglu.py 269-270, grouped_linear.py 896-936); shared experts 2 f_s + f_s per N
  (shared_experts.py 200-207). N is s b / t_sp for any etp: routing runs on the sequence shard; R = etp N k under
  uniform routing (token_dispatcher.py 741-751), the experts' width f / etp.
`recompute_modules` (TransformerConfig l. 560-583): core_attn frees the softmax stats (Q, K, V stay as the
checkpoint's inputs, O as proj's input); mla_up_proj discards q, k, v, the up projections' norm outputs and rsigma
and pins the whole kv_combined (+ rope width) and the SP-gathered k_pos_emb (multi_latent_attention.py 455-457,
983-987; tensor_parallel/random.py 944-996); layernorm discards a standalone norm's output and rstd (MLA's input
norm, MoE's pre-MLP norm; the dense TE spec's norms are fused into the linears: no effect, transformer_layer.py
475-527); mlp checkpoints a dense MLP, keeping its input (c h / t_sp); moe checkpoints the MoE layer, keeping the
norm's output; moe_act discards the experts' fc2 input; shared_experts checkpoints the shared experts.
Not counted: dropout masks (hidden_dropout 0), aux / z-loss scores, the dispatcher's per-layer attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.analytic.memory.activations import LSE_BYTES
from backend.analytic.memory.family_bytes import STAT_BYTES
from backend.analytic.memory.moe_bytes import INDEX_BYTES


@dataclass(frozen=True)
class MlaWidths:
    """Multi-latent attention's widths (DeepSeek-V2 / V3)."""
    q_lora: int
    """0: no q compression (q projected straight from the norm's output)."""
    kv_lora: int
    rope: int
    nope: int
    v_head: int


@dataclass(frozen=True)
class MoeWidths:
    """A routed MLP's sizes on one rank: the expert and shared-expert widths, and rows received per token."""
    experts: int
    top_k: int
    expert_ffn: int
    """f / etp: one rank's slice of an expert's hidden."""
    shared_ffn: int
    rows_per_token: float
    """R / N: rows this rank's local experts receive per routed token (etp x k under uniform routing)."""
    sigmoid: bool


@dataclass(frozen=True)
class TeLayer:
    """What one Transformer Engine block's saved bytes depend on."""
    s: int
    b: int
    h: int
    q: int
    """Heads x head width of q and O."""
    kv: int
    """kv heads x head width (h_kv)."""
    a: int
    f: int
    gated: bool
    t: int
    sp: bool
    norm_stats: int
    """fp32 statistics per token and norm: rsigma (RMSNorm) or mu + rsigma (LayerNorm)."""
    c: int
    fp8: bool
    mla: MlaWidths | None = None
    moe: MoeWidths | None = None
    modules: frozenset[str] = frozenset()
    """The recompute modules in force (empty: nothing recomputed)."""
    fused_attention: bool = True
    """False: Megatron's unfused core attention (module docstring): the softmax output per score instead of the
    fused kernel's fp32 statistics."""


def te_layer_bytes(layer: TeLayer) -> float:
    """One TE block's saved bytes under `layer.modules` (module docstring)."""
    return attention_bytes(layer) + mlp_bytes(layer)


def attention_bytes(layer: TeLayer) -> float:
    if layer.mla is not None:
        return _mla_bytes(layer, layer.mla)
    sb, t, c = layer.s * layer.b, layer.t, layer.c
    t_sp = t if layer.sp else 1
    norm = (c + (1 if layer.fp8 else c)) * layer.h + layer.norm_stats * STAT_BYTES  # input, output, stats
    split = c * (2 * layer.q + 2 * layer.kv) + (layer.q if layer.fp8 else 0)  # Q, K, V, O (+ proj's fp8 O)
    return sb * (norm / t_sp + (split + _scores_bytes(layer)) / t)


def _scores_bytes(layer: TeLayer) -> float:
    """Per token and tp rank x t: what the core attention keeps beyond Q, K, V and O (nothing under core_attn)."""
    if "core_attn" in layer.modules:
        return 0
    return LSE_BYTES * layer.a if layer.fused_attention else layer.c * layer.a * layer.s


def _mla_bytes(layer: TeLayer, mla: MlaWidths) -> float:
    sb, t, c, h, a, mods = layer.s * layer.b, layer.t, layer.c, layer.h, layer.a, layer.modules
    t_sp = t if layer.sp else 1
    up = "mla_up_proj" in mods
    low = 1 if layer.fp8 else c
    whole = c * h  # the input norm's input
    if "layernorm" not in mods:
        whole += (2 * h if layer.fp8 else c * h) + STAT_BYTES  # its output (fp8: each down projection's copy), rstd
    whole += c * mla.q_lora + c * (mla.kv_lora + (mla.rope if up else 0))  # up-proj inputs (U: all of kv_combined)
    if not up:
        whole += low * (mla.q_lora + mla.kv_lora) + STAT_BYTES * (2 if mla.q_lora else 1)  # up-proj norms
    split = c * a * mla.v_head + _scores_bytes(layer)  # O, the softmax's statistics or scores
    if not up:
        split += c * a * (2 * (mla.nope + mla.rope) + mla.v_head)  # q, k, v
    gathered_rope = c * mla.rope if up and t_sp > 1 else 0  # k_pos_emb all-gathered over the SP ranks, kept whole
    return sb * (whole / t_sp + split / t + gathered_rope)


def mlp_bytes(layer: TeLayer) -> float:
    sb, t, c, h = layer.s * layer.b, layer.t, layer.c, layer.h
    t_sp = t if layer.sp else 1
    if layer.moe is not None:
        return sb / t_sp * _moe_bytes_per_token(layer, layer.moe)
    if "mlp" in layer.modules:
        return sb * c * h / t_sp  # the checkpoint's input (the norm is fused into fc1)
    norm = (c + (1 if layer.fp8 else c)) * h + layer.norm_stats * STAT_BYTES
    g = 2 if layer.gated else 1
    return sb * (norm / t_sp + (c * g * layer.f + (1 if layer.fp8 else c) * layer.f) / t)


def _moe_bytes_per_token(layer: TeLayer, moe: MoeWidths) -> float:
    """Per routed token N (module docstring)."""
    c, h, mods = layer.c, layer.h, layer.modules
    out = c * h  # the pre-MLP norm's input
    norm_out = c * h + layer.norm_stats * STAT_BYTES
    if "moe" in mods:
        return out + (0 if "layernorm" in mods else norm_out)  # the checkpoint keeps the norm's output
    if "layernorm" not in mods:
        out += norm_out
    k, e, f, low = moe.top_k, moe.experts, moe.expert_ffn, 1 if layer.fp8 else c
    out += 8 * k + (4 * e + 4 * k + 4 if moe.sigmoid else 4 * k)  # top-k ids; probabilities
    out += INDEX_BYTES * (e + k)  # the unfused permutation's pinned argsort and sort order
    per_row = low * h + 2 * c * f + c + (0 if "moe_act" in mods else low * f)
    out += moe.rows_per_token * per_row
    if "shared_experts" not in mods and moe.shared_ffn:
        out += (2 * c + low) * moe.shared_ffn
    return out
