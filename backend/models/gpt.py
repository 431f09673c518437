"""Decoder family (GPT, Llama/Mistral/Qwen2-style dense, Mixtral-style MoE, MoE with shared experts; Qwen3 q/k norms,
Gemma 3 sandwich norms and sliding windows, gpt-oss sinks and clamped SwiGLU experts with biases, Llama 4 interleaved
MoE and chunked attention, DeepSeek-V2/V3 latent attention (MLA), dense prefix and sigmoid / group-limited routing)
that `backend.analytic.params` counts to the element.

Layout (names are relied on by the TP plan and the PP splitter):
  tok_emb, pos_emb (learned positions only) -> layers["0".."L-1"] (ln1, attn.{q,k,v,o,q_norm,k_norm,sinks} or MLA's
  attn.{q_a,q_a_norm,q_b | q, kv_a, kv_a_norm, kv_b, o}, [ln1_post], ln2, mlp, [ln2_post]) -> norm -> lm_head
  mlp: gelu {fc_in, fc_out} | swiglu {gate, up, down} | MoE {router, experts.E.<gelu|swiglu>, shared.<gelu|swiglu>,
  shared_gate}; ln1/ln2/norm are nn.LayerNorm (weight, bias) or nn.RMSNorm (weight).
Biases (ModelSpec.bias): all -> every block Linear; qkv -> q, k, v only; none. lm_head and the router never.
Tied embeddings: lm_head.weight is tok_emb.weight (reported once, as tok_emb.weight). GPT defaults: LayerNorm,
GELU, learned positions, untied, biases everywhere, math attention.
Pipeline stages are built by deleting modules (tok_emb/pos_emb/norm/lm_head set to None, layers popped
from the ModuleDict), as torchtitan does, so parameter names stay stable across strategies.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from backend.models.checkpointing import op_policy, resolve_ops, run_blocks
from backend.models.moe_capacity import AuxLossScaler, aux_scores, capacity_keep, load_balancing_loss
from backend.models.moe_sorted import dense_dispatch
from backend.recompute_policy import DEFAULT_SAC_OPS, parse
from backend.spec import AttentionImpl, Bias, Mlp, ModelSpec, Norm, Positions, RouterScore, WindowKind
from backend.torch_compat import current_graph_task_id, is_fake_tensor

INIT_THREADS_ENV = "SHARDLAB_INIT_THREADS"


def make_norm(m: ModelSpec) -> nn.Module:
    """nn.LayerNorm (weight, bias) or nn.RMSNorm (weight), named ln1 / ln2 / norm by their owners."""
    return nn.RMSNorm(m.d_model, eps=m.norm_eps) if m.norm == Norm.RMSNORM else nn.LayerNorm(m.d_model, eps=m.norm_eps)


def rope_cos_sin(T: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (Su et al. 2021, RoFormer Eq. 34; the half-split layout of HF Llama): (T, d) cos and sin for
    positions 0..T-1, or for `positions` (context parallelism: this rank's global positions). Positions are global:
    under SP the attention input has been all-gathered to the full T."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    at = torch.arange(T, device=device, dtype=torch.float32) if positions is None else positions.float()
    freqs = torch.outer(at, inv_freq)  # (T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d): x*cos + rotate_half(x)*sin. Autograd saves only cos and sin (the muls' constants)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """A parameter as the tensor this rank computes with: under tensor parallelism a Replicate DTensor (q / k norms,
    MLA's latent projections, applied to this rank's heads only) becomes its local copy whose gradient is a partial
    sum over tp, a Shard(0) one (sinks) its local heads; a plain tensor as is."""
    if not hasattr(w, "to_local"):
        return w
    if w.placements[0].is_replicate():
        from torch.distributed.tensor import Partial

        return w.to_local(grad_placements=[Partial()])
    return w.to_local()


def _rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, norm.normalized_shape, local_weight(norm.weight), norm.eps)


def _linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if lin.bias is None else local_weight(lin.bias)
    return F.linear(x, local_weight(lin.weight), bias)


def attention_mask(m: ModelSpec, layer: int, T: int, device: torch.device) -> torch.Tensor | None:
    """(T, T) bool, True where a query may attend: causal, narrowed to the window on a windowed layer; None for a
    plain causal layer (the kernels' own causal path)."""
    if m.layer_is_global(layer):
        return None
    i = torch.arange(T, device=device)
    causal = i[None, :] <= i[:, None]
    if m.window_kind == WindowKind.CHUNKED:  # Llama 4: causal inside chunks of `window` tokens
        return causal & (i[None, :] // m.window == i[:, None] // m.window)
    return causal & (i[:, None] - i[None, :] < m.window)  # the last `window` positions, itself included


class Sinks(nn.Module):
    """gpt-oss's learned attention sink: one logit per head that joins each row's softmax (its value is zero).
    A module of its own so tensor parallelism can split it by heads like q's output rows."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def local(self) -> torch.Tensor:
        return local_weight(self.weight)


class Attention(nn.Module):
    def __init__(self, m: ModelSpec, layer: int = 0):
        super().__init__()
        self.spec, self.layer = m, layer
        self.head_dim = m.head_dim
        q_dim, kv_dim = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
        qkv_bias, o_bias = m.bias in (Bias.ALL, Bias.QKV), m.bias == Bias.ALL
        self.q = nn.Linear(m.d_model, q_dim, bias=qkv_bias)
        self.k = nn.Linear(m.d_model, kv_dim, bias=qkv_bias)
        self.v = nn.Linear(m.d_model, kv_dim, bias=qkv_bias)
        self.o = nn.Linear(q_dim, m.d_model, bias=o_bias)
        if m.qk_norm:
            self.q_norm = nn.RMSNorm(m.head_dim, eps=m.norm_eps)
            self.k_norm = nn.RMSNorm(m.head_dim, eps=m.norm_eps)
        self.sinks = Sinks(m.n_heads) if m.attention_sinks else None
        self.rope = m.positions == Positions.ROPE and not (m.global_layers_nope and m.layer_is_global(layer)
                                                            and m.window is not None)
        self.flash = m.attention == AttentionImpl.FLASH
        self.selective_recompute = False
        self.context_parallel = None
        """Set by strategies/cp.py: `.positions(T, device)` (this rank's global token positions) and
        `.attention(q, k, v)` (ring attention over the cp group) replace arange(T) and the core."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # view(..., -1, head_dim) keeps working when TP leaves only the local heads on this rank.
        q = self.q(x).view(B, T, -1, self.head_dim)
        k = self.k(x).view(B, T, -1, self.head_dim)
        if self.spec.qk_norm:  # Qwen3 / Gemma 3: per-head RMSNorm before the rotation
            q, k = _rms_norm(self.q_norm, q), _rms_norm(self.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, a, T, d)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_cos_sin(T, self.head_dim, q.device, q.dtype, token_positions(self, T, q.device))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return self.o(self.core(q, k, v).transpose(1, 2).reshape(B, T, -1))  # (B, T, C)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over the layer's mask, checkpointed under selective recompute; under context
        parallelism the ring attention (plain causal: spec.checks refuses cp with windows or sinks)."""
        mask = attention_mask(self.spec, self.layer, q.shape[-2], q.device)
        sinks = self.sinks.local() if self.sinks is not None else None
        if self.context_parallel is not None:
            run = self.context_parallel.attention
        elif self.flash:
            run = lambda q_, k_, v_: _flash_attention(q_, k_, v_, mask)  # noqa: E731
        else:
            run = lambda q_, k_, v_: _core_attention(q_, k_, v_, mask, sinks)  # noqa: E731
        if self.selective_recompute and torch.is_grad_enabled():
            return checkpoint(run, q, k, v, use_reentrant=False)
        return run(q, k, v)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, Sec 2.1): q and the keys / values come from
    low-rank latents. q = q_b(q_a_norm(q_a(x))) (or q(x)) split into a no-rope part and a rotary part per head;
    kv_a(x) = [latent c (kv_lora) | one rotary key shared by all heads]; kv_b(kv_a_norm(c)) gives each head's no-rope
    key and its value (v_head_dim wide); o maps the heads' values back. Hugging Face's DeepseekV3Attention layout."""

    def __init__(self, m: ModelSpec, layer: int = 0):
        super().__init__()
        self.spec, self.layer = m, layer
        a, qk, bias = m.n_heads, m.head_dim, m.bias in (Bias.ALL, Bias.QKV)
        if m.q_lora_rank:
            self.q_a = nn.Linear(m.d_model, m.q_lora_rank, bias=bias)
            self.q_a_norm = nn.RMSNorm(m.q_lora_rank, eps=m.norm_eps)
            self.q_b = nn.Linear(m.q_lora_rank, a * qk, bias=bias)
        else:
            self.q = nn.Linear(m.d_model, a * qk, bias=bias)
        self.kv_a = nn.Linear(m.d_model, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_norm = nn.RMSNorm(m.kv_lora_rank, eps=m.norm_eps)
        self.kv_b = nn.Linear(m.kv_lora_rank, a * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o = nn.Linear(a * m.v_head_dim, m.d_model, bias=m.bias == Bias.ALL)
        self.flash = m.attention == AttentionImpl.FLASH
        self.selective_recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.spec
        B, T, _ = x.shape
        nope, rope, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        if hasattr(x, "to_local"):  # tp: every rank runs the (replicated) latent projections for its own heads
            from torch.distributed.tensor import Partial

            x = x.to_local(grad_placements=[Partial()])
        # Plain local matmuls for q / q_b / kv_b too: called as modules, ColwiseParallel would wrap their local input as
        # a Replicate DTensor and all-reduce its gradient, which the Partial boundary above then sums over tp again.
        q = _linear(self.q_b, _rms_norm(self.q_a_norm, _linear(self.q_a, x))) if m.q_lora_rank else _linear(self.q, x)
        q = q.view(B, T, -1, nope + rope).transpose(1, 2)  # (B, a, T, nope + rope)
        latent, k_rope = _linear(self.kv_a, x).split([m.kv_lora_rank, rope], dim=-1)
        kv = _linear(self.kv_b, _rms_norm(self.kv_a_norm, latent)).view(B, T, -1, nope + vd).transpose(1, 2)
        k_nope, v = kv.split([nope, vd], dim=-1)
        cos, sin = rope_cos_sin(T, rope, q.device, q.dtype)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        k_rope = apply_rope(k_rope.view(B, 1, T, rope), cos, sin)
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        mask = attention_mask(m, self.layer, T, x.device)
        run = (lambda q_, k_, v_: _padded_flash_attention(q_, k_, v_, mask)) if self.flash else \
            (lambda q_, k_, v_: _core_attention(q_, k_, v_, mask, None))  # noqa: E731
        y = checkpoint(run, q, k, v, use_reentrant=False) if self.selective_recompute and torch.is_grad_enabled() \
            else run(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    # Explicit softmax(QK^T)V, not SDPA: it saves the (B, a, T, T) scores that Korthikanti's 5as/h term counts.
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, a, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1) if allowed is None else ~allowed
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v  # (B, a, T, d)
    # gpt-oss: each head's sink logit is one more column of every row's softmax; its probability is dropped
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, T, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)
    return probs[..., :-1] @ v


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    # torch SDPA restricted to its fused kernels (CPU: the flash kernel; CUDA: flash or memory-efficient): autograd
    # saves q, k, v, the output and the (B, a, T) logsumexp, never a (T, T) tensor (Dao et al. 2022, Sec 3.1); a
    # windowed layer passes its (T, T) bool mask, which the kernel keeps for backward.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _padded_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """_flash_attention for a v narrower than q and k (MLA's v_head_dim). On CUDA SDPA's memory-efficient kernel takes
    both widths as they are. The CPU has only the flash kernel, which takes one width for q, k and v (else "No
    available kernel"), so there v is zero-padded to q's width and the output sliced back, as Hugging Face's
    DeepSeek-V3 does for flash_attention_2 (huggingface/transformers
    src/transformers/models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3Attention.forward, commit f5a9ec5). The
    zero columns leave the first v_head_dim output columns, the softmax scale (q's width) and the gradients as
    they were."""
    pad = q.shape[-1] - v.shape[-1]
    if pad <= 0 or q.device.type != "cpu":
        return _flash_attention(q, k, v, allowed)
    return _flash_attention(q, k, F.pad(v, (0, pad)), allowed)[..., :v.shape[-1]]


class MLP(nn.Module):
    """GELU MLP: fc_out(gelu(fc_in(x)))."""

    def __init__(self, d_model: int, ffn: int, bias: bool = True):
        super().__init__()
        self.fc_in = nn.Linear(d_model, ffn, bias=bias)
        self.fc_out = nn.Linear(ffn, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6)."""

    def __init__(self, d_model: int, ffn: int, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(d_model, ffn, bias=bias)
        self.up = nn.Linear(d_model, ffn, bias=bias)
        self.down = nn.Linear(ffn, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)) (Shazeer 2020 Eq. 5 with the tanh GELU: Gemma's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class ClampedSwiGLU(SwiGLU):
    """gpt-oss's expert MLP: gate clamped above at 7, up to [-7, 7], down(gate * sigmoid(1.702 gate) * (up + 1))."""

    LIMIT, ALPHA = 7.0, 1.702

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x).clamp(max=self.LIMIT)
        up = self.up(x).clamp(-self.LIMIT, self.LIMIT)
        return self.down(gate * torch.sigmoid(gate * self.ALPHA) * (up + 1))


_MLPS = {Mlp.GELU: MLP, Mlp.SWIGLU: SwiGLU, Mlp.GEGLU: GeGLU, Mlp.SWIGLU_CLAMPED: ClampedSwiGLU}


def make_mlp(m: ModelSpec, ffn: int) -> nn.Module:
    return _MLPS[Mlp(m.mlp)](m.d_model, ffn, bias=m.bias == Bias.ALL)


class MoE(nn.Module):
    """Top-k routed experts, dropless unless `capacity_factor` is set (Megatron's per-rank limit and drop policy:
    models/moe_capacity.py), plus
    optional always-on shared experts (DeepSeekMoE, Dai et al. 2024 Sec 3.2), fused into one MLP `shared` of
    n_shared_experts x shared_ffn_hidden, optionally scaled by sigmoid(shared_gate(x)) (Qwen2-MoE).

    `dispatch` is swapped by the ep strategy for an all-to-all version; this dense one is the reference.
    The shared experts are dense: under ep they are replicated like the attention.
    """

    def __init__(self, m: ModelSpec):
        super().__init__()
        self.spec = m
        self.top_k = m.top_k
        self.n_experts = m.n_experts
        self.router = nn.Linear(m.d_model, m.n_experts, bias=m.router_bias)
        if m.router_balance_bias:  # DeepSeek-V3: moved by the balancing rule, not by gradients (a buffer)
            self.register_buffer("balance_bias", torch.zeros(m.n_experts))
        self.experts = nn.ModuleList(make_mlp(m, m.expert_ffn) for _ in range(m.n_experts))
        self.run_empty_experts = False
        """Run experts no token reached on 0 rows (zero grads, not None): set by the data-parallel wrappers, whose
        reducers need every rank to produce the same parameter set; the reference keeps None grads."""
        self.shared = make_mlp(m, m.shared_ffn) if m.shared_ffn else None
        self.shared_gate = nn.Linear(m.d_model, 1, bias=False) if m.shared_ffn and m.shared_expert_gate else None
        self.usage: Any = None
        self.grouped_reason: str | None = None
        """Why the last call ran the per-expert loop although moe_grouped_gemm is on (None: grouped, or off)."""
        """step.ExpertUsage: told which experts real rows reached (`mark_used`)."""
        self.aux_loss_scale = 1.0
        """The main loss's backward scale per microbatch (moe_capacity.set_aux_loss_scale)."""
        self.aux_group: Any = None
        """The sequence shards' process group (cp) the load-balancing loss sums its counts over; None: one shard."""
        self.capacity_groups: torch.Tensor | None = None
        """Per sequence position, the rank that holds it (the reference under cp: the capacity limit is per rank)."""
        self.capacity_log: list[tuple[int, torch.Tensor]] = []
        """(routed slots, dropped slots as a 0-dim tensor) per first forward since the last reset (activation
        checkpointing's re-runs are not counted); read and cleared by the step's owner."""

    def reset_buffers(self) -> None:
        if hasattr(self, "balance_bias"):
            self.balance_bias.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, idx, _ = self.route_scores(x)
        return weights, idx

    def route_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (N, k), expert ids (N, k), scores (N, E)) of the N tokens x."""
        logits = self.router(x)  # (N, E)
        m = self.spec
        scores = torch.sigmoid(logits) if m.router_score == RouterScore.SIGMOID else torch.softmax(logits, dim=-1)
        choice = scores + self.balance_bias if hasattr(self, "balance_bias") else scores
        if m.expert_groups > 1:
            choice = self._group_limited(choice.detach())
        idx = torch.topk(choice, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.top_k == 1 and weights.requires_grad:
            # w / w is exactly 1, so its true gradient is 0; autograd's g/w - g*w/w^2 leaves ~1e-10 of rounding
            # that differs between the dense and all-to-all dispatch, and Adam scales that noise up to full steps.
            weights.register_hook(torch.zeros_like)
        return weights, idx, scores

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek's group-limited routing: only the experts of each token's best topk_groups groups stay eligible
        (a group scores its best expert, or the sum of its best two under the balance bias: V2's
        group_limited_greedy, V3's noaux_tc)."""
        m = self.spec
        grouped = choice.view(choice.shape[0], m.expert_groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1) if hasattr(self, "balance_bias") \
            else grouped.max(dim=-1).values
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(m.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        m = self.spec
        if m.capacity_factor is None and not m.moe_aux_loss_coeff and not m.moe_grouped_gemm:
            weights, idx = self.route(flat)
            out = self.dispatch(flat, weights, idx)
        else:
            out = self._routed(flat, T)
        if self.shared is not None:
            shared = self.shared(flat)  # (N, C)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        return out.view(B, T, C)

    def _routed(self, flat: torch.Tensor, T: int) -> torch.Tensor:
        """forward's MoE part with the capacity limit, the load-balancing loss or grouped GEMMs
        (models/moe_capacity.py)."""
        m = self.spec
        weights, idx, scores = self.route_scores(flat)
        aux = None
        if m.moe_aux_loss_coeff:
            aux = load_balancing_loss(aux_scores(None, scores, m.router_score == RouterScore.SIGMOID), idx,
                                      self.n_experts, m.moe_aux_loss_coeff, self.aux_group)
        kept = None
        if m.capacity_factor is not None:
            groups = None if self.capacity_groups is None else self.capacity_groups.repeat(flat.shape[0] // T)
            kept = capacity_keep(weights, idx, self.n_experts, m.capacity_factor, m.moe_pad_to_capacity, groups)
            if current_graph_task_id() == -1:  # a first forward, not activation checkpointing's re-run
                self.capacity_log.append((idx.numel(), kept.dropped))
        out = self.dispatch(flat, weights, idx, kept)
        return out if aux is None else AuxLossScaler.apply(out, aux, self.aux_loss_scale)

    def mark_used(self, expert: nn.Module) -> None:
        if self.usage is not None:
            self.usage.mark(expert)

    def dispatch(self, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, kept: Any = None) -> torch.Tensor:
        if kept is not None or self.spec.moe_grouped_gemm:
            return dense_dispatch(self, flat, weights, idx, kept)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                self.mark_used(expert)
            if not tok.numel() and not self.run_empty_experts:
                continue
            # Under a data-parallel wrapper an expert no token reached still runs (on 0 rows): its grads are zeros,
            # not None, so every rank reduces the same parameter set (FSDP2's reduce-scatter and DDP's reducer
            # need that); the optimizer skips it exactly as the reference skips a None grad (step.ExpertUsage).
            out.index_add_(0, tok, (expert(flat[tok]) * weights[tok, slot].unsqueeze(-1)).to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, m: ModelSpec, layer: int = 0):
        super().__init__()
        self.ln1 = make_norm(m)
        self.attn = LatentAttention(m, layer) if m.is_mla else Attention(m, layer)
        self.ln1_post = make_norm(m) if m.sandwich_norm else None
        self.ln2 = make_norm(m)
        self.mlp = MoE(m) if m.layer_is_moe(layer) else make_mlp(m, m.ffn)
        self.ln2_post = make_norm(m) if m.sandwich_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no named temporaries: the attention output must die at the add (a live one is measured in the MLP's peak)
        x = x + _post_norm(self.ln1_post, self.attn(self.ln1(x)))  # Gemma: the sublayer output is normed too
        return x + _post_norm(self.ln2_post, self.mlp(self.ln2(x)))


def _post_norm(norm: nn.Module | None, y: torch.Tensor) -> torch.Tensor:
    return y if norm is None else norm(y)


class GPT(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.spec = m
        self.tok_emb: nn.Embedding | None = nn.Embedding(m.vocab_size, m.d_model)
        self.pos_emb: nn.Embedding | None = (nn.Embedding(m.seq_len, m.d_model) if m.positions == Positions.LEARNED
                                             else None)
        self.layers = nn.ModuleDict({str(i): Block(m, i) for i in range(m.n_layers)})
        self.norm: nn.Module | None = make_norm(m)
        self.lm_head: nn.Linear | None = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # named_parameters() reports it once, as tok_emb.weight
        self.recompute: tuple[str, int] = ("none", 0)
        self.sac_context: Any = None
        self.context_parallel = None  # as Attention.context_parallel (strategies/cp.py)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 on the first stage, hidden (B, T, C) on later ones; logits (B, T, V) on the last."""
        h = tokens
        if self.tok_emb is not None:
            h = self.tok_emb(tokens)  # (B, T, C)
            if self.spec.scale_embeddings:  # Gemma: sqrt(h)-scaled embeddings (a constant: nothing saved)
                h = h * self.spec.d_model ** 0.5
            if self.pos_emb is not None:
                h = h + self.pos_emb(token_positions(self, tokens.shape[1], tokens.device))
        h = run_blocks(list(self.layers.values()), h, *self.recompute, self.sac_context)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def token_positions(owner: nn.Module, T: int, device: torch.device) -> torch.Tensor | None:
    """The global positions of the T local tokens: arange(T) (None for RoPE, which makes its own), or this cp rank's
    share of the sequence under context parallelism."""
    cp = owner.context_parallel
    if cp is not None:
        return cp.positions(T, device)
    return None if isinstance(owner, Attention) else torch.arange(T, device=device)


def set_recompute(model: GPT, mode: str, ops: tuple[str, ...] = DEFAULT_SAC_OPS) -> None:
    """The policy of backend/recompute_policy.py (`ops`: what `op` saves): block-level ones through
    models/checkpointing.py, `selective` inside each block's attention."""
    kind, layers = parse(mode)
    model.recompute = (kind, layers)
    model.sac_context = op_policy(resolve_ops(tuple(ops))) if kind == "op" else None
    for layer in model.layers.values():
        layer.attn.selective_recompute = kind == "selective"


def build_model(m: ModelSpec, *, seed: int, recompute: str = "none", device: str | torch.device = "cpu",
                recompute_ops: tuple[str, ...] = DEFAULT_SAC_OPS) -> GPT:
    """The full model with the weights every strategy and rank uses (`init_weights`); `device="meta"` builds
    it without storage (the engine's path: parallelize first, then materialize only this rank's shards)."""
    with torch.device("meta"):
        model = GPT(m)
    set_recompute(model, recompute, recompute_ops)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        tie_weights(model)
        init_weights(model, seed)
    return model


def tie_weights(model: nn.Module) -> None:
    """Re-tie lm_head to tok_emb where the model ties them and holds both (`to_empty` and `parallelize_module`
    replace each module's parameter separately, which unties them)."""
    spec = getattr(model, "spec", None)
    if spec is not None and spec.tie_embeddings and getattr(model, "tok_emb", None) is not None \
            and getattr(model, "lm_head", None) is not None:
        model.lm_head.weight = model.tok_emb.weight


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a function of (seed, parameter name) only, so a rank holding any
    slice of a parameter draws it from the same full tensor as the single-process reference."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def full_init(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` on the CPU: N(0, 0.02) for matrices and embeddings,
    zeros for biases, ones for norm weights (LayerNorm's own default)."""
    if len(shape) >= 2:
        g = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, 0.02, generator=g)
    fill = 0.0 if name.endswith("bias") else 1.0
    return torch.full(shape, fill, dtype=torch.float32, device="cpu")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, local_slice=None) -> None:
    """Write every parameter's initial value, one parameter at a time: the full tensor is drawn on the CPU and
    `local_slice(param, full)` (default: all of it) picks what this rank holds (a DTensor shard, an FSDP shard).
    Largest first: the big full-size temporaries come while few local shards exist yet, so the host peak stays
    near the local shards plus one block-sized parameter (plus up to N-1 more with SHARDLAB_INIT_THREADS=N)."""
    tied = bool(getattr(getattr(model, "spec", None), "tie_embeddings", False))
    params = sorted(model.named_parameters(), key=lambda kv: -kv[1].numel())

    def draw(name: str, p: torch.Tensor) -> torch.Tensor:
        # a last pipeline stage's lm_head is the reference's tok_emb.weight (tied): draw it from that name
        return full_init("tok_emb.weight" if tied and name == "lm_head.weight" else name, p.shape, seed)

    for (_name, p), full in zip(params, _drawn(params, draw), strict=False):
        local = full if local_slice is None else local_slice(p, full)
        dst = p.to_local() if hasattr(p, "to_local") else p
        dst.copy_(local.to(device=dst.device, dtype=dst.dtype))
        del full, local
    for name, mod in model.named_modules():
        if any(True for _ in mod.buffers(recurse=False)):
            if not hasattr(mod, "reset_buffers"):
                raise TypeError(f"{name or 'model'} ({type(mod).__name__}) has buffers but no reset_buffers(): "
                                "after to_empty they would hold garbage; give it one that recomputes them")
            mod.reset_buffers()


def init_threads() -> int:
    """SHARDLAB_INIT_THREADS (default 1): threads drawing initial values ahead of the copy loop."""
    raw = os.environ.get(INIT_THREADS_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{INIT_THREADS_ENV} must be a positive integer (got {raw!r})")
    return int(raw)


def _drawn(params: list[tuple[str, torch.Tensor]], draw) -> Iterator[torch.Tensor]:
    """draw(name, p) for each parameter, in order. With init_threads() = N > 1 the next N are drawn in N threads
    (torch releases the GIL in normal_; each parameter has its own generator, so the values are identical).
    Fake parameters (the trace) are drawn in this thread: a dispatch mode is thread-local."""
    threads = init_threads()
    if threads <= 1 or not params or is_fake_tensor(_local(params[0][1])):
        for name, p in params:
            yield draw(name, p)
        return
    todo = iter(params)
    with ThreadPoolExecutor(threads) as pool:
        pending = deque(pool.submit(draw, name, p) for name, p in islice(todo, threads))
        while pending:
            full = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(draw, *nxt))
            yield full


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32. Vocab-sharded DTensor logits (loss parallel, strategies/tp.loss_context) give a
    replicated DTensor loss: its local value is the loss, the backward still runs through the DTensor ops."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return loss.to_local() if hasattr(loss, "to_local") else loss
