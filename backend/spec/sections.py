"""The parts of an experiment spec: model shape, training, parallelism, runtime. Each field has its bounds and a
docstring; the cross-field checks are in checks.py, the whole spec in experiment.py."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from backend.recompute_policy import DEFAULT_SAC_OPS, ops_problem, parse, spelled
from backend.spec import dims
from backend.spec.choices import (
    DP_FLAVOURS,
    ZERO_STAGE,
    AttentionImpl,
    AttentionKernel,
    Backend,
    Bias,
    Device,
    Elementwise,
    Executor,
    Fp8Recipe,
    Framework,
    Mlp,
    MoeDispatcher,
    Norm,
    Offload,
    Optimizer,
    Positions,
    Precision,
    Recompute,
    RouterScore,
    Stack,
    StackDtype,
    Strategy,
    WindowKind,
)
from backend.spec.dims import MAX_WORLD
from backend.spec.user_text import source_problem

MAX_DIM = 1_000_000
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_SEQ = 10_000_000
MAX_BATCH = 100_000_000
MAX_STEPS = 1_000_000


_NUMBERS = (int, float, int | None, float | None)


class SpecSection(BaseModel):
    """A part of the spec: unknown keys are refused, booleans are never read as numbers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: a sweep value `true` for zero_stage or world_size is a mistake
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError(f"{value!r} is a boolean, not a number")
        return value


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
    """MoE under ep > 1: alltoall (the routed rows over the ep group) or allgather (every token to every ep rank, the
    combined output reduce-scattered back; Megatron-Core's --moe-token-dispatcher-type)."""
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
    def _bounded_source(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if problem := source_problem(value):
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


class TrainSpec(SpecSection):
    global_batch: int = Field(8, ge=1, le=MAX_BATCH)
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch: int = Field(2, ge=1, le=MAX_BATCH)
    """Sequences per microbatch on one data-parallel rank."""
    microbatches: int | None = Field(None, ge=1, le=MAX_BATCH)
    """Microbatches per step per data-parallel rank; None derives global_batch / (micro_batch * dp)."""
    steps: int = Field(5, ge=1, le=MAX_STEPS)
    """Timed training steps (after warm-up)."""
    warmup_steps: int = Field(1, ge=0, le=MAX_STEPS)
    """Untimed steps before timing starts."""
    precision: Precision = Precision.FP32
    """fp32, bf16/fp16 mixed precision (fp32 master weights: ZeRO's K=12), or fp8 (float8 linears, bf16 elsewhere)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    """fp8 only: torchao's scaling recipe, tensorwise or rowwise."""
    fp8_all_gather: bool = True
    """fp8 with FSDP2 (zero2 / zero3) and the tensorwise recipe (the only one torchao's FSDP2 float8 all-gather takes):
    all-gather the float8 linears' weights in fp8 (enable_fsdp_float8_all_gather), half their bf16 bytes."""
    optimizer: Optimizer = Optimizer.ADAMW
    """AdamW (2 states) or SGD with momentum (1 state)."""
    lr: float = Field(1e-3, gt=0, le=10)
    """Learning rate."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core), full (every block), op (torchtitan's op-level SAC
    over `recompute_ops`), layers:K (every K-th block), block:N / uniform:N (Megatron's recompute methods with
    --recompute-num-layers N); see backend/recompute_policy.py."""
    recompute_ops: list[str] | None = None
    """Ops whose outputs `op` recompute saves (torch op names such as aten.mm.default); None: torchtitan's list
    (recompute_policy.DEFAULT_SAC_OPS)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for weights and synthetic data: every strategy starts from identical weights."""
    stack: Stack = Stack.SHARDLAB
    """The software stack the job trains with (backend/spec/stacks.py): shardlab (this engine), torchtitan, megatron
    (Megatron-Core + Transformer Engine) or deepspeed. It gives the default of every setting below (None = its
    default)."""
    attention_kernel: AttentionKernel | None = None
    """The attention core's kernel: eager, flash2, flash3, cudnn (TE / cuDNN fused), efficient, flash1, flash-triton."""
    elementwise: Elementwise | None = None
    """Element-wise work: eager (one kernel per operator), compiled (torch.compile) or fused (TE / Apex kernels)."""
    param_dtype: StackDtype | None = None
    """The dtype the persistent parameters are kept in (FSDP2: fp32 shards; Megatron / DeepSpeed: 16-bit; fp8 with
    Megatron's --fp8-param-gather)."""
    grad_reduce_dtype: StackDtype | None = None
    """The dtype gradients are accumulated and reduced in (FSDP2 reduce_dtype; Megatron's main-grad buffer, bf16 with
    --grad-reduce-in-bf16; DeepSpeed's grad_accum_dtype)."""
    master_dtype: StackDtype | None = None
    """The optimizer's master weights: fp32 copies of 16-bit params, or none (the params are the master)."""
    loss_parallel: bool | None = None
    """Vocab-parallel cross-entropy over tp: the logits stay sharded (V/tp per rank), no all-gather."""
    tp_overlap: bool | None = None
    """TP collectives hidden behind the matmuls they feed (torchtitan's async TP, Megatron's --tp-comm-overlap);
    needs sequence parallelism."""
    grad_reduce_overlap: bool | None = None
    """Data-parallel gradient reduction overlapped with backward (Megatron --overlap-grad-reduce)."""
    param_gather_overlap: bool | None = None
    """Data-parallel parameter all-gather overlapped with forward (Megatron --overlap-param-gather, FSDP prefetch)."""
    pp_overlap: bool | None = None
    """Pipeline send / recv overlapped with compute (Megatron's overlap_p2p_comm)."""
    optimizer_over_cp: bool | None = None
    """Optimizer state sharded over dp x cp (Megatron's data_parallel_group_with_cp) rather than dp alone."""


    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_grammar(cls, value: Any) -> str:
        return spelled(*parse(value.value if isinstance(value, Recompute) else value))

    @field_validator("recompute_ops")
    @classmethod
    def _known_ops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (problem := ops_problem(value)):
            raise ValueError(problem)
        return value

    @property
    def recompute_kind(self) -> tuple[str, int]:
        """('layers', 2) for 'layers:2', ('full', 0) for 'full'."""
        return parse(self.recompute)

    @property
    def fp8_gathers(self) -> bool:
        """fp8 weights all-gathered in fp8 under FSDP2 (torchao supports it for tensorwise scaling only)."""
        return str(self.precision) == "fp8" and self.fp8_all_gather and self.fp8_recipe == Fp8Recipe.TENSORWISE

    @property
    def sac_ops(self) -> tuple[str, ...]:
        return tuple(self.recompute_ops) if self.recompute_ops is not None else DEFAULT_SAC_OPS


class ParallelHead(SpecSection):
    """The fields of `ParallelSpec` before the dimensions' (backend/spec/dims.py)."""

    strategy: Strategy = Strategy.DDP
    """Headline strategy; mixes combine a data-parallel flavour (ddp..fsdp) with tp/pp/ep degrees."""
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Total ranks; None means dp * cp * tp * pp."""


ParallelDegrees = dims.spec_model(dims.DIMS, ParallelHead)
"""`ParallelHead` and every field of the dimension table: the degrees dp, tp, pp, ep, cp and their options
(sequence_parallel, pp_schedule, virtual_stages, cp_rotate, cp_load_balance), each with its bounds and docstring."""
_DEGREES = dims.degree_names(dims.DIMS)


class ParallelSpec(ParallelDegrees):
    offload: Offload = Offload.NONE
    """Host (CPU) offload: optimizer (DeepSpeed offload_optimizer) or params (params, grads and optimizer
    state: DeepSpeed offload_param + offload_optimizer, torch FSDP2 CPUOffloadPolicy for zero2/zero3)."""

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE.get(self.strategy, 0)

    def degrees(self) -> dict[str, int]:
        """{dimension: degree} (an underived dp counts as 1)."""
        return {d: getattr(self, d) or 1 for d in _DEGREES}

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank. The mesh is (pp, dp, cp, tp), row-major, tp fastest-varying (torchtitan's
        order); "cp" is present when cp > 1. Expert-parallel groups are consecutive blocks of ep ranks along the
        data-parallel index dp * cp + cp index (`data_parallel_index`). Laid out by backend/spec/dims.py."""
        return dims.coords(dims.DIMS, self.degrees(), rank)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters: dp x cp. Gradients are averaged over them and ZeRO / FSDP shards
        span them (torchtitan's dp_shard_cp, Megatron's data-parallel group with cp)."""
        return (self.dp or 1) * self.cp

    def data_parallel_index(self, rank: int) -> int:
        """The rank's index in its dp x cp group (dp index * cp + cp index): its FSDP shard and ZeRO-1 share."""
        return (rank // self.tp) % self.dp_cp

    def rank_at(self, **at: int) -> int:
        """The global rank at these mesh coordinates (rank_at(pp=0, dp=1, cp=0, tp=1); inverse of `coords`)."""
        return dims.rank_at(dims.DIMS, self.degrees(), at)

    @property
    def dp_flavour(self) -> Strategy:
        """The data-parallel wrapper used for the dp dimension (plain DDP for the pure tp/pp/ep strategies)."""
        return self.strategy if self.strategy in DP_FLAVOURS else Strategy.DDP


class RuntimeSpec(SpecSection):
    backend: Backend = Backend.AUTO
    """Process-group backend: auto picks nccl when CUDA is present, else gloo."""
    device: Device = Device.AUTO
    """Device: auto picks cuda (one rank per GPU) when present, else cpu."""
    nnodes: int = Field(1, ge=1, le=100_000)
    """Machines in the job (torchrun --nnodes)."""
    node_rank: int = Field(0, ge=0, le=100_000)
    """This machine's index (torchrun --node-rank)."""
    rdzv_endpoint: str | None = Field(None, max_length=255)
    """host:port of the c10d rendezvous for multi-node jobs; None runs standalone."""
    timeout_s: float = Field(600.0, gt=0, le=7 * 24 * 3600)
    """Wall-clock limit for the whole job; also bounds hung collectives."""
    executor: Executor = Executor.LOCAL
    """Where the worker runs it: local (torchrun on the worker's machine) or slurm (sbatch on the cluster of
    shardlab.toml [slurm]; nnodes nodes, rendezvous at the allocation's first node)."""


class SpecParts(Protocol):
    """What the cross-field checks read of a spec (an ExperimentSpec while it validates)."""

    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec
    runtime: RuntimeSpec
    framework: Framework
