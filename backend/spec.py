"""The one typed experiment spec that flows UI -> DB -> launcher -> ranks -> results -> plots.

Every rejection names the offending values and shows the arithmetic, in the style of torchtitan's
`ParallelDims`: "dp(2) * tp(3) * pp(1) = 6 != world_size(4)".
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from backend.recompute_policy import DEFAULT_SAC_OPS, ops_problem, parse, spelled
from backend.spec_text import MAX_NAME_CHARS, InputError, check_depth, load_json_text, source_problem, text_problem

MAX_DIM = 1_000_000
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_SEQ = 10_000_000
MAX_WORLD = 1_000_000
MAX_BATCH = 100_000_000
MAX_STEPS = 1_000_000


class Strategy(StrEnum):
    """Headline strategy. ddp..fsdp name the data-parallel flavour; tp/pp/ep are the pure model-parallel ones."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"
    TP = "tp"
    PP = "pp"
    EP = "ep"


class Schedule(StrEnum):
    """Pipeline schedules, each backed by a `torch.distributed.pipelining` schedule class."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"  # ScheduleInterleavedZeroBubble
    ZBV = "zbv"  # ScheduleZBVZeroBubble (V-shaped, 2 stages per rank)


class Precision(StrEnum):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP8 = "fp8"
    """float8 linears (torchao's float8 training, `fp8_recipe` scaling), bf16 mixed precision elsewhere."""


class Fp8Recipe(StrEnum):
    """torchao's float8 scaling recipes (Float8LinearConfig.from_recipe_name)."""

    TENSORWISE = "tensorwise"  # one dynamic scale per tensor (e4m3 forward, e5m2 gradients)
    ROWWISE = "rowwise"  # one dynamic scale per row (e4m3 everywhere)


class Optimizer(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


class Recompute(StrEnum):
    """The named recompute policies; `layers:K`, `block:N` and `uniform:N` take a block count
    (backend/recompute_policy.py describes every one)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OP = "op"


class CpRotate(StrEnum):
    """How context parallelism moves K/V between the cp ranks: torch's `set_rotate_method` names."""

    ALLGATHER = "allgather"  # one all-gather of every rank's K/V per attention call (torch's default)
    ALLTOALL = "alltoall"  # K/V passed round the ring: cp - 1 all-to-all permutations per attention call


class Backend(StrEnum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Framework(StrEnum):
    """Which framework runs the step: torch-native (backend/strategies), DeepSpeed's engine, or JAX/XLA GSPMD
    (backend/frameworks/). What each one runs is declared in backend/frameworks/capabilities.py."""

    TORCH = "torch"
    DEEPSPEED = "deepspeed"
    JAX = "jax"


class Offload(StrEnum):
    """What lives on the host (CPU) instead of the accelerator between uses."""

    NONE = "none"
    OPTIMIZER = "optimizer"  # DeepSpeed offload_optimizer: fp32 master partition + Adam states, step on the CPU
    PARAMS = "params"  # params too: DeepSpeed offload_param (stage 3) + offload_optimizer; FSDP2 CPUOffloadPolicy


class Executor(StrEnum):
    LOCAL = "local"
    SLURM = "slurm"


class Norm(StrEnum):
    """Normalisation layer of every block and the final norm."""

    LAYERNORM = "layernorm"  # weight + bias (GPT-2, GPT-3, GPT-NeoX)
    RMSNORM = "rmsnorm"  # weight only (Llama, Mistral, Mixtral, Qwen2)


class Mlp(StrEnum):
    """Dense MLP / expert block."""

    GELU = "gelu"  # fc_in (h -> f), GELU, fc_out (f -> h): 2 matrices
    SWIGLU = "swiglu"  # down(silu(gate(x)) * up(x)): 3 matrices (Shazeer 2020, "GLU Variants")
    GEGLU = "geglu"  # down(gelu_tanh(gate(x)) * up(x)): 3 matrices (Shazeer 2020; Gemma)
    SWIGLU_CLAMPED = "swiglu_clamped"  # gpt-oss: gate clamped <= 7, up to [-7, 7], down(gate*sigmoid(1.702 gate)*(up+1))


GATED_MLPS = (Mlp.SWIGLU, Mlp.GEGLU, Mlp.SWIGLU_CLAMPED)
"""The three-matrix (gate, up, down) MLPs."""


class RouterScore(StrEnum):
    """How the MoE router turns logits into expert scores."""

    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE, DeepSeek-V2: softmax over experts, then top-k
    SIGMOID = "sigmoid"  # DeepSeek-V3, Llama 4: per-expert sigmoid, top-k, weights renormalised


class WindowKind(StrEnum):
    """What a windowed attention layer lets a query see."""

    SLIDING = "sliding"  # the last `window` positions, itself included (Mistral, Gemma 3, gpt-oss)
    CHUNKED = "chunked"  # causal inside fixed chunks of `window` tokens (Llama 4's attention_chunk_size)


class Positions(StrEnum):
    LEARNED = "learned"  # pos_emb (seq_len, h) added to the token embedding
    ROPE = "rope"  # rotary q/k rotation (Su et al. 2021), no parameters


class Bias(StrEnum):
    """Which Linear layers of the blocks carry a bias (lm_head and the MoE router never do)."""

    ALL = "all"  # q, k, v, o and the MLP (GPT-2)
    NONE = "none"  # none (Llama, Mistral, Mixtral)
    QKV = "qkv"  # q, k, v only (Qwen2)


class AttentionImpl(StrEnum):
    MATH = "math"  # explicit softmax(QK^T)V: the (b, a, s, s) probabilities are saved for backward
    FLASH = "flash"  # torch SDPA's fused kernel: saves q, k, v, out and the logsumexp, never s x s (Dao et al. 2022)


DP_FLAVOURS = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP)
ZERO_STAGE = {Strategy.DDP: 0, Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3, Strategy.FSDP: 3}
MULTI_STAGE_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE, Schedule.ZBV)


_NUMBERS = (int, float, int | None, float | None)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: a sweep value `true` for zero_stage or world_size is a mistake
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError(f"{value!r} is a boolean, not a number")
        return value


class ModelSpec(_Section):
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


class TrainSpec(_Section):
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


class ParallelSpec(_Section):
    strategy: Strategy = Strategy.DDP
    """Headline strategy; mixes combine a data-parallel flavour (ddp..fsdp) with tp/pp/ep degrees."""
    world_size: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Total ranks; None means dp * cp * tp * pp."""
    dp: int | None = Field(None, ge=1, le=MAX_WORLD)
    """Data-parallel degree (batch split); None derives world_size / (cp * tp * pp)."""
    tp: int = Field(1, ge=1, le=MAX_WORLD)
    """Tensor-parallel degree."""
    pp: int = Field(1, ge=1, le=MAX_WORLD)
    """Pipeline-parallel degree (stages = pp * virtual_stages)."""
    ep: int = Field(1, ge=1, le=MAX_WORLD)
    """Expert-parallel degree; experts are split over ep ranks carved out of the dp x cp ranks."""
    cp: int = Field(1, ge=1, le=MAX_WORLD)
    """Context-parallel degree: every sequence is split over cp ranks (ring attention); they hold the same
    parameters, so gradients are averaged and FSDP / ZeRO state is sharded over dp x cp (torchtitan's dp_shard_cp)."""
    cp_rotate: CpRotate = CpRotate.ALLGATHER
    """How K/V reach the other cp ranks: allgather (once per attention call) or alltoall (round the ring)."""
    cp_load_balance: bool = True
    """Causal load balancing: rank i holds sequence chunks i and 2cp-1-i of 2cp (head-tail, as torchtitan and
    Megatron), so every cp rank does the same attention work; off: contiguous chunks (the last rank does most)."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence (needs tp > 1)."""
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule (used when pp > 1)."""
    virtual_stages: int = Field(1, ge=1, le=1024)
    """Model chunks per pipeline rank (interleaved schedules need >= 2)."""
    offload: Offload = Offload.NONE
    """Host (CPU) offload: optimizer (DeepSpeed offload_optimizer) or params (params, grads and optimizer
    state: DeepSpeed offload_param + offload_optimizer, torch FSDP2 CPUOffloadPolicy for zero2/zero3)."""

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE.get(self.strategy, 0)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank. The mesh is (pp, dp, cp, tp), row-major, tp fastest-varying (torchtitan's
        order); "cp" is present when cp > 1. Expert-parallel groups are consecutive blocks of ep ranks along the
        data-parallel index dp * cp + cp index (`data_parallel_index`)."""
        tp, cp, dp = self.tp, self.cp, self.dp or 1
        c = {"pp": rank // (dp * cp * tp), "dp": (rank // (tp * cp)) % dp}
        if cp > 1:
            c["cp"] = (rank // tp) % cp
        c["tp"] = rank % tp
        c["ep"] = self.data_parallel_index(rank) % self.ep
        return c

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters: dp x cp. Gradients are averaged over them and ZeRO / FSDP shards
        span them (torchtitan's dp_shard_cp, Megatron's data-parallel group with cp)."""
        return (self.dp or 1) * self.cp

    def data_parallel_index(self, rank: int) -> int:
        """The rank's index in its dp x cp group (dp index * cp + cp index): its FSDP shard and ZeRO-1 share."""
        return (rank // self.tp) % self.dp_cp

    def rank_at(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these mesh coordinates (inverse of `coords`)."""
        return ((pp * (self.dp or 1) + dp) * self.cp + cp) * self.tp + tp

    @property
    def dp_flavour(self) -> Strategy:
        """The data-parallel wrapper used for the dp dimension (plain DDP for the pure tp/pp/ep strategies)."""
        return self.strategy if self.strategy in DP_FLAVOURS else Strategy.DDP


class RuntimeSpec(_Section):
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


class SpecError(ValueError):
    """A spec that cannot run, with every problem listed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class ExperimentSpec(_Section):
    name: str = Field("", max_length=MAX_NAME_CHARS)
    """Free-text label shown in the history (plain text: no control characters)."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """Transformer shape."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """Batch, steps, precision, optimizer, recompute, seed."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Strategy and degrees."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Backend, device, nodes and timeout."""
    framework: Framework = Framework.TORCH
    """torch (native strategies), deepspeed (DeepSpeed's ZeRO engine) or jax (XLA GSPMD on virtual CPU devices)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if problem := text_problem(value, "name", MAX_NAME_CHARS):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ExperimentSpec:
        from backend.spec_checks import RunOnly, derive_and_check  # it needs the section classes defined above

        problems = derive_and_check(self)
        if (info.context or {}).get("predict_only"):
            problems = [p for p in problems if not isinstance(p, RunOnly)]
        if problems:
            raise SpecError(problems)
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.model.seq_len

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> ExperimentSpec:
        return cls.model_validate_json(text)

    @classmethod
    def for_prediction(cls, data: dict[str, Any]) -> ExperimentSpec:
        """Validate a layout the analytic model can predict but this engine cannot run (ZeRO-1 x TP/PP =
        Megatron's distributed optimizer, split-backward schedules x FSDP, EP x TP/PP): every check except
        the `spec_checks.RunOnly` ones. Such a spec is for estimate / plan only, never for the launcher."""
        return cls.model_validate(data, context={"predict_only": True})


def validate_spec(data: dict[str, Any] | str, *, predict_only: bool = False) -> tuple[ExperimentSpec | None, list[str]]:
    """Parse a spec from a dict or JSON text; return (spec, []) or (None, problems). Never raises: a spec too big
    or nested too deep (backend/spec_text.py limits) is a problem like any other.
    predict_only: every check except the run-only ones (see `ExperimentSpec.for_prediction`, `spec_checks.run_blockers`)."""
    context = {"predict_only": True} if predict_only else None
    try:
        if isinstance(data, (str, bytes)):
            data = load_json_text(data, "the spec")
        else:
            check_depth(data, "the spec")
        spec = ExperimentSpec.model_validate(data, context=context)
        return spec, []
    except InputError as e:
        return None, [str(e)]
    except SpecError as e:
        return None, list(e.problems)
    except ValidationError as e:
        problems: list[str] = []
        for err in e.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            # pydantic wraps the model validator's SpecError: keep its problems as separate items
            problems += ctx_err.problems if isinstance(ctx_err, SpecError) else [_format_pydantic(err)]
        return None, problems


def _format_pydantic(err: dict[str, Any]) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ())) or "spec"
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    shown = repr(err.get("input"))
    if len(shown) > 80:  # a 100 KB name must not become a 100 KB error message
        shown = f"{shown[:60]}... ({len(shown):,} characters)"
    return f"{loc}: {msg} (got {shown})"
