"""The closed sets of values a spec field takes (strategies, schedules, precisions, model-family choices) and the
facts tied to them (which strategies are data-parallel flavours, their ZeRO stage, the multi-stage schedules)."""

from __future__ import annotations

from enum import StrEnum


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
    DUALPIPEV = "dualpipev"  # ScheduleDualPipeV (DeepSeek's DualPipe in a V: 2 stages per rank, microbatches >= 2 pp)


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


class RecomputeModule(StrEnum):
    """Megatron-Core's `--recompute-modules` under selective recompute (TransformerConfig.recompute_modules,
    megatron/core/transformer/transformer_config.py @d98e8a64 l. 560-583): the submodules checkpointed. The memory
    each one frees is in backend/analytic/memory/megatron_recompute.py."""

    CORE_ATTN = "core_attn"  # the attention core (Megatron's default, ShardLab's `selective`)
    MLP = "mlp"  # the dense MLP submodule (MoE layers: not affected, transformer_layer.py l. 531-533)
    MOE = "moe"  # the whole MoE layer
    MOE_ACT = "moe_act"  # the experts' activation function (output discarded, grouped GEMM only)
    SHARED_EXPERTS = "shared_experts"  # the MoE layer's shared experts
    LAYERNORM = "layernorm"  # input_layernorm and pre_mlp_layernorm (output discarded)
    MLA_UP_PROJ = "mla_up_proj"  # multi-latent attention's up projections and RoPE (output discarded)


MEGATRON_DEFAULT_RECOMPUTE_MODULES = (RecomputeModule.CORE_ATTN,)
"""TransformerConfig.__post_init__ (l. 1940-1941): recompute_modules None means ["core_attn"]."""


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
    (backend/frameworks/). What each one runs is declared in backend/spec/framework_support.py."""

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
    # gpt-oss: gate clamped <= 7, up to [-7, 7], down(gate*sigmoid(1.702 gate)*(up+1))
    SWIGLU_CLAMPED = "swiglu_clamped"


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


class MoeDispatcher(StrEnum):
    """How an expert-parallel MoE layer moves its tokens to the experts' ranks (Megatron-Core's
    --moe-token-dispatcher-type; token_dispatcher.py @ core_v0.19.0, flex @ d98e8a64)."""

    ALLTOALL = "alltoall"  # MoEAlltoAllTokenDispatcher: the routed rows only, by all_to_all over the ep group
    ALLGATHER = "allgather"  # MoEAllGatherTokenDispatcher: every token to every tp x ep rank, reduce-scatter back
    FLEX = "flex"  # MoEFlexTokenDispatcher (DeepEP / HybridEP): once per rank holding its experts, once per node across


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
MULTI_STAGE_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE, Schedule.ZBV, Schedule.DUALPIPEV)
V_SHAPE_SCHEDULES = (Schedule.ZBV, Schedule.DUALPIPEV)
"""Rank r holds stages r and 2pp - 1 - r (torch's generate_stage_to_rank_mapping(style="v")): exactly 2 per rank."""


class Stack(StrEnum):
    """The software stack a job trains with (backend/spec/stacks.py: one entry each, its defaults and their sources)."""

    SHARDLAB = "shardlab"  # ShardLab's own eager-torch engine (backend/strategies): what every run here measures
    TORCHTITAN = "torchtitan"  # pytorch/torchtitan: FSDP2 / DTensor TP, torch.compile, torchao float8, async TP
    MEGATRON = "megatron"  # Megatron-Core with Transformer Engine (Megatron-LM, NeMo)
    DEEPSPEED = "deepspeed"  # DeepSpeed's ZeRO engine around a torch model


FOLDED_EXPERT_STACKS = frozenset({Stack.MEGATRON})
"""Stacks that lay the routed experts out on a grid of their own over a stage's ranks, so ep may span the tp ranks
(Megatron-Core's MoE parallel folding: analytic/expert_layout.py); the others carve ep out of dp x cp."""


def expert_grid_fits(tp: int, dp_cp: int, ep: int, etp: int, folded: bool) -> bool:
    """ep fits a stage's expert grid: carved out of dp x cp, or, on a folded grid with etp < tp (the tp ranks route
    their own tokens), etp x ep dividing the stage's tp x cp x dp ranks (Megatron-Core: world % (etp x ep x pp)
    == 0)."""
    if folded and etp < tp:
        return (tp * dp_cp) % (etp * ep) == 0
    return dp_cp % ep == 0


class AttentionKernel(StrEnum):
    """The attention core's kernel, as the step-time model times it (steptime/ops.attention_time)."""

    EAGER = "eager"  # explicit softmax(QK^T)V: two batched GEMMs and the (s x s) softmax through memory
    FLASH2 = "flash2"  # FlashAttention-2 (flash-attn 2.x, torch SDPA's flash backend)
    FLASH3 = "flash3"  # FlashAttention-3 (Hopper only; Shah et al. 2024)
    CUDNN = "cudnn"  # cuDNN fused attention (Transformer Engine's FusedAttention, torch SDPA's cuDNN backend)
    EFFICIENT = "efficient"  # xformers / torch SDPA's memory-efficient kernel
    FLASH1 = "flash1"  # FlashAttention v1 (Dao et al. 2022), the kernel of 2022-2023 runs
    FLASH_TRITON = "flash-triton"  # FlashAttention's Triton port (MosaicML's attn_impl: triton)


class Elementwise(StrEnum):
    """How the element-wise work (norms, activations, RoPE, residual adds, casts) runs."""

    EAGER = "eager"  # one kernel per PyTorch operator
    COMPILED = "compiled"  # torch.compile (inductor) fuses each chain of point-wise / reduction ops into one kernel
    FUSED = "fused"  # hand-fused kernels (Megatron / Transformer Engine / Apex)


class StackDtype(StrEnum):
    """A dtype a framework keeps parameters, gradient reduction or master weights in."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    NONE = "none"  # master weights only: no separate master copy (the parameters are fp32 themselves)
