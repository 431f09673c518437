"""The model section of a spec: the transformer's shape and its family features, each field with its bounds and
docstring."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from backend.spec.choices import (
    AttentionImpl,
    Bias,
    Mlp,
    MoeDispatcher,
    Norm,
    Positions,
    RouterScore,
    WindowKind,
)
from backend.spec.section_base import MAX_DIM, MAX_LAYERS, MAX_SEQ, MAX_VOCAB, SpecSection, reading_back
from backend.spec.user_text import source_problem


class ModelSpec(SpecSection):
    vocab_size: int = Field(256, ge=2, le=MAX_VOCAB)
    """Vocabulary size V (token embedding rows and LM-head outputs)."""
    d_model: int = Field(128, ge=1, le=MAX_DIM)
    """Hidden size h."""
    n_layers: int = Field(2, ge=1, le=MAX_LAYERS)
    """Number of transformer blocks L."""
    n_heads: int = Field(4, ge=1, le=MAX_DIM)
    """Attention (query) heads a."""
    n_kv_heads: int | None = Field(None, ge=1, le=MAX_DIM)
    """Key/value heads for GQA; None means n_heads (plain multi-head attention)."""
    ffn_hidden: int | None = Field(None, ge=1, le=16 * MAX_DIM)
    """MLP hidden size; None means 4 * d_model."""
    seq_len: int = Field(64, ge=1, le=MAX_SEQ)
    """Sequence length s (also the number of learned positions)."""
    n_experts: int = Field(0, ge=0, le=100_000)
    """MoE experts per layer; 0 means a dense MLP."""
    top_k: int = Field(2, ge=1, le=100_000)
    """Experts each token is routed to (MoE only)."""
    norm: Norm = Norm.LAYERNORM
    """Normalisation: layernorm (weight + bias) or rmsnorm (weight only)."""
    mlp: Mlp = Mlp.GELU
    """MLP / expert type: gelu (fc_in, fc_out) or swiglu (gate, up, down)."""
    positions: Positions = Positions.LEARNED
    """Position encoding: learned (pos_emb, seq_len x h parameters) or rope (no parameters)."""
    tie_embeddings: bool = False
    """lm_head shares tok_emb's weight (GPT-2). Under pp > 1 the first and last stage each hold a copy whose
    gradients are summed every step, as Megatron does."""
    bias: Bias = Bias.ALL
    """Linear biases in the blocks: all, none, or qkv (q, k, v only)."""
    expert_ffn_hidden: int | None = Field(None, ge=1, le=16 * MAX_DIM)
    """Hidden size of each routed expert; None means ffn (fine-grained MoE uses a smaller one)."""
    n_shared_experts: int = Field(0, ge=0, le=1024)
    """Always-active shared experts per MoE layer (DeepSeekMoE / Qwen-MoE), run as one MLP of
    n_shared_experts * shared_ffn_hidden; 0 means none."""
    shared_ffn_hidden: int | None = Field(None, ge=1, le=16 * MAX_DIM)
    """Hidden size of ONE shared expert; None means expert_ffn."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(Linear(h, 1)) per token (Qwen2-MoE)."""
    attention: AttentionImpl = AttentionImpl.MATH
    """Attention kernel: math (scores saved, Korthikanti's 5as/h term) or flash (SDPA fused, no s x s saved)."""
    norm_eps: float = Field(1e-5, gt=0, le=1)
    """Epsilon of every norm (numerics only: no effect on memory or FLOPs)."""
    attn_head_dim: int | None = Field(None, ge=1, le=MAX_DIM)
    """Width of one q / k / v head; None means d_model / n_heads (Qwen3, Gemma 3, gpt-oss and Llama 4 set their own:
    q is then n_heads * attn_head_dim wide, o maps that back to d_model)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k with a (head_dim,) weight each (Qwen3, Gemma 3)."""
    attention_sinks: bool = False
    """A learned logit per head that joins every softmax and takes probability mass (gpt-oss): n_heads parameters."""
    sandwich_norm: bool = False
    """Norms after the attention and after the MLP too, before each residual add (Gemma 2/3): 4 norms per block."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(d_model) (Gemma): no parameters."""
    q_lora_rank: int | None = Field(None, ge=1, le=MAX_DIM)
    """MLA (DeepSeek-V2/V3): q through a low-rank down projection of this width and its RMSNorm; None projects q
    directly (DeepSeek-V2-Lite). Needs kv_lora_rank."""
    kv_lora_rank: int | None = Field(None, ge=1, le=MAX_DIM)
    """MLA: width of the compressed latent KV (one per token, shared by all heads, the only thing cached besides the
    rope key); None means ordinary attention."""
    qk_nope_head_dim: int = Field(0, ge=0, le=MAX_DIM)
    """MLA: per-head q / k width without rotary position (from the latent)."""
    qk_rope_head_dim: int = Field(0, ge=0, le=MAX_DIM)
    """MLA: decoupled rotary width: per head for q, one shared rope key per token for k."""
    v_head_dim: int = Field(0, ge=0, le=MAX_DIM)
    """MLA: per-head value width (o maps n_heads * v_head_dim back to d_model)."""
    first_dense_layers: int = Field(0, ge=0, le=MAX_LAYERS)
    """MoE: the first k blocks keep a dense MLP of ffn_hidden (DeepSeek's first_k_dense_replace)."""
    moe_every: int = Field(1, ge=1, le=MAX_LAYERS)
    """MoE: after the dense prefix, block i is MoE when (i + 1) % moe_every == 0, dense otherwise (Qwen-MoE's
    decoder_sparse_step, Llama 4's interleave_moe_layer_step); 1 = every block."""
    router_score: RouterScore = RouterScore.SOFTMAX
    """MoE: softmax or sigmoid expert scores."""
    router_bias: bool = False
    """MoE: the router Linear has a bias (gpt-oss): n_experts parameters per MoE block."""
    router_balance_bias: bool = False
    """MoE: a per-expert bias added to the scores for choosing experts only, moved by the load-balancing rule rather
    than by gradients (DeepSeek-V3's auxiliary-loss-free e_score_correction_bias): a buffer, not a parameter."""
    expert_groups: int = Field(1, ge=1, le=100_000)
    """MoE: group-limited routing (DeepSeek): experts form this many groups and a token picks its top-k experts only
    from its best topk_groups groups; 1 = no limit."""
    topk_groups: int = Field(1, ge=1, le=100_000)
    """MoE: groups a token may route into (expert_groups > 1)."""
    capacity_factor: float | None = Field(None, gt=0, le=1_000)
    """MoE: expert capacity factor (Megatron-Core's --moe-expert-capacity-factor): per MoE layer and microbatch each
    rank lets at most C = ceil(T k / E x capacity_factor) of its T tokens' k slots reach one expert and drops the rest,
    lowest router probability first (moe_utils.apply_router_token_dropping, drop policy "probs"); None = dropless."""
    moe_pad_to_capacity: bool = False
    """MoE: every expert takes exactly C rows per rank, padded with zero-weight rows (Megatron-Core's
    --moe-pad-expert-input-to-capacity): static dispatch shapes, E x C rows sent. Needs capacity_factor."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0, le=1_000)
    """MoE: the router's load-balancing loss coeff x E / (k T^2) x sum_i P_i c_i (Switch Transformer; Megatron-Core's
    switch_load_balancing_loss_func and --moe-aux-loss-coeff) is added to the training loss, computed before dropping;
    0 = off (Megatron's default; its recipes set 1e-2)."""
    moe_dispatcher: MoeDispatcher = MoeDispatcher.ALLTOALL
    """MoE under ep > 1 (Megatron-Core's --moe-token-dispatcher-type): alltoall (the routed rows over the ep group),
    allgather (every token of the tp x ep group to each of its ranks, the combined output reduce-scattered back) or
    flex (DeepEP / HybridEP: a token once to each rank holding one of its experts, once to each such node across
    nodes). This engine runs alltoall; the other two are predicted only."""
    moe_imbalance: float = Field(1.0, ge=1, le=1_000)
    """MoE prediction: the busiest rank's expert load over the uniform load (1 = uniform routing, the default). A run
    measures its own (its per-rank routing note); dispatch buffers, all-to-all volume and expert GEMMs scale with it
    unless a capacity factor bounds them (backend/analytic/moe_rows.py)."""
    moe_grouped_gemm: bool = False
    """MoE: a rank's local experts run as one grouped GEMM per expert weight (torch.nn.functional.grouped_mm;
    Megatron-Core's --moe-grouped-gemm) where the shapes allow it, else one GEMM per expert (the reason in the
    notes)."""
    window: int | None = Field(None, ge=1, le=MAX_SEQ)
    """Windowed attention: tokens a query sees (sliding) or the chunk length (chunked) on the windowed layers; None
    means every layer attends to the whole causal prefix."""
    window_kind: WindowKind = WindowKind.SLIDING
    """sliding (Mistral, Gemma 3, gpt-oss) or chunked (Llama 4)."""
    global_every: int = Field(0, ge=0, le=MAX_LAYERS)
    """With a window: block i attends globally when (i + 1) % global_every == 0 (gpt-oss 2, Llama 4 4, Gemma 3 6);
    0 = every block windowed."""
    global_layers_nope: bool = False
    """The global layers use no rotary position (Llama 4's NoPE layers)."""
    source: dict[str, Any] | None = None
    """Where this shape came from: {"preset": name} or {"hf_config": the config.json dict, "file": name};
    kept with the spec so a run remembers it. None for a hand-written shape."""

    @field_validator("source")
    @classmethod
    def _bounded_source(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if not reading_back(info) and (problem := source_problem(value)):
            raise ValueError(problem)
        return value

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """q / k width of one head (MLA: nope + rope)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether block `layer` holds the MoE (the dense prefix and the moe_every interleave)."""
        return self.is_moe and layer >= self.first_dense_layers and (layer + 1) % self.moe_every == 0

    def layer_is_global(self, layer: int) -> bool:
        """Whether block `layer` attends to the whole causal prefix (no window, or one of the global layers)."""
        return self.window is None or (self.global_every > 0 and (layer + 1) % self.global_every == 0)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden or self.ffn

    @property
    def shared_ffn(self) -> int:
        """Hidden size of the fused shared-expert MLP (all shared experts together); 0 without them."""
        return self.n_shared_experts * (self.shared_ffn_hidden or self.expert_ffn)
