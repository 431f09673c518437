"""The training section of a spec: batch, steps, precision, optimizer, recompute and the stack's settings, each
field with its bounds and docstring."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from backend.recompute_policy import DEFAULT_SAC_OPS, ops_problem, parse, spelled
from backend.spec.choices import (
    AttentionKernel,
    Elementwise,
    Fp8Recipe,
    Optimizer,
    Precision,
    Recompute,
    RecomputeModule,
    Stack,
    StackDtype,
)
from backend.spec.section_base import MAX_BATCH, MAX_STEPS, SpecSection


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
    recompute_modules: list[RecomputeModule] | None = None
    """stack megatron, recompute selective: Megatron-Core's `--recompute-modules`, the submodules checkpointed
    (core_attn, mlp, moe, moe_act, shared_experts, layernorm, mla_up_proj); None: Megatron's default, core_attn."""
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
    ep_overlap: bool | None = None
    """Expert-parallel all-to-alls hidden behind another microbatch's compute (Megatron's
    --overlap-moe-expert-parallel-comm: each steady-state 1F1B step runs one microbatch's forward beside another's
    backward, layer by layer); needs ep > 1."""
    loss_compiled: bool | None = None
    """The cross-entropy runs under torch.compile (torchtitan's compile of the loss): Inductor fuses the fp32 upcast,
    log-softmax and their gradient, so neither fp32 logits nor fp32 log-probs are materialised (the 16-bit logits are
    saved instead, and their gradient is 16-bit)."""


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

    @field_validator("recompute_modules")
    @classmethod
    def _distinct_modules(cls, value: list[RecomputeModule] | None) -> list[RecomputeModule] | None:
        return None if value is None else list(dict.fromkeys(value))

    @property
    def sac_ops(self) -> tuple[str, ...]:
        return tuple(self.recompute_ops) if self.recompute_ops is not None else DEFAULT_SAC_OPS
