"""The stack settings the memory model reads (issue 34 part 2), resolved once per spec or per plan: a per-call
constant of `Layout` (`Layout.stack`), like its precision. None = ShardLab's own engine (the exact, measured model
of backend/analytic/memory is used unchanged).

What each framework keeps is read from its source at the commits pinned in backend/spec/stacks.py (and
/work/wt/research/stacks.md); memory/stack_states.py and memory/stack_activations.py hold the terms. The
*mechanism* (whose buffers: Megatron-Core's param and grad buffers, FSDP2's sharded parameters, DeepSpeed's ZeRO
partitions) follows the stack; every byte count follows the resolved settings (param / grad / master dtypes,
optimizer over dp x cp, loss parallel, attention kernel, element-wise fusion), so a person's own mix is priced as
set.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Protocol

from backend.spec.choices import MEGATRON_DEFAULT_RECOMPUTE_MODULES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec, TrainSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "none": 0}
CORE_ATTN_ONLY = frozenset(str(m) for m in MEGATRON_DEFAULT_RECOMPUTE_MODULES)
"""What selective recompute checkpoints unless Megatron's --recompute-modules says otherwise: Korthikanti's
attention core, the textbook selective policy."""
MECHANISMS = ("megatron", "fsdp2", "deepspeed")


class DpGroups(Protocol):
    """The data-parallel group sizes of an analytic/layout.Layout (a Protocol: layout.py imports this module, so
    naming Layout here would be an import cycle)."""

    @property
    def dp(self) -> Num: ...
    @property
    def dp_cp(self) -> Num: ...


class StackSource(Protocol):
    """What `stack_memory` reads of a spec: an ExperimentSpec, or stack_memory_of_train's stand-in (its train and
    model sections and a default parallel section)."""

    @property
    def train(self) -> TrainSpec: ...
    @property
    def model(self) -> ModelSpec: ...


@dataclass(frozen=True)
class StackMemory:
    """The resolved settings of a non-default stack that change memory (hashable: memo keys use it)."""

    mechanism: str
    """Whose buffers: megatron (Megatron-Core DDP param / grad buffers + DistributedOptimizer or
    Float16OptimizerWithFloat16Params), fsdp2 (torchtitan's fully_shard + MixedPrecisionPolicy), deepspeed (ZeRO)."""
    param_bytes: int
    """Bytes per persistent parameter element (param_dtype)."""
    grad_bytes: int
    """Bytes per gradient element as accumulated / reduced (grad_reduce_dtype)."""
    master_bytes: int
    """Bytes per fp32 master element (master_dtype; 0 = none, the params are the master)."""
    optimizer_over_cp: bool
    """The optimizer state is sharded over dp x cp (Megatron's intra_dp_cp_group), not dp alone."""
    loss_parallel: bool
    """Vocab-parallel cross-entropy: logits and their gradients are V / tp per rank."""
    te_layer: bool
    """Transformer Engine's fused modules (elementwise = fused): LayerNormLinear saves the norm input and output."""
    fused_attention: bool
    """A flash / cuDNN / memory-efficient attention kernel: Q, K, V, O and an fp32 logsumexp are saved, no scores."""
    fp8: bool
    """precision fp8: float8 GEMMs (TE under megatron, torchao otherwise)."""
    fp8_all_gather: bool
    """FSDP2 all-gathers float8 linears' weights in fp8 (torchao enable_fsdp_float8_all_gather)."""
    fp8_params: bool
    """param_dtype fp8 under fp8 precision: Megatron's --fp8-param-gather (TE's linear weights are Float8Tensors)."""
    recompute_modules: frozenset[str] = CORE_ATTN_ONLY
    """Megatron's --recompute-modules: what a layout with recompute selective checkpoints (other policies ignore it);
    memory/te_block.py prices each module."""
    ep_overlap: bool = False
    """Megatron's --overlap-moe-expert-parallel-comm: its combined 1F1B schedule runs one more forward chunk before
    the steady state under pipelining (schedules.py @d98e8a64 966-971), held in flight with the others."""
    loss_compiled: bool = False
    """The cross-entropy runs under torch.compile (torchtitan): memory/stack_activations.head_bytes' compiled terms."""
    te_ring: bool = False
    """Context parallelism runs Transformer Engine's ring, not torch's (spec/stacks.StackEntry.cp_ring;
    traffic.cp_ring_bytes)."""
    compiled_blocks: bool = False
    """elementwise compiled: each block runs under torch.compile (torchtitan's apply_compile), whose partitioner saves
    only what backward reads (memory/stack_activations._block_terms)."""

    @property
    def textbook_selective(self) -> bool:
        """Selective recompute checkpoints the attention core alone (Korthikanti's policy)."""
        return self.recompute_modules == CORE_ATTN_ONLY

    def optimizer_group(self, layout: DpGroups) -> Num:
        """Ranks the optimizer state is sharded over: dp x cp, or dp alone. `layout`: an analytic/layout.Layout."""
        return layout.dp_cp if self.optimizer_over_cp else layout.dp


def stack_memory(spec: StackSource, device: str) -> StackMemory | None:
    """The memory settings of a spec's stack on `device` ("cpu" or "cuda"), None for stack shardlab (this engine's
    own model, whatever its settings: the engine's measured memory is what its settings change). `spec`: an
    ExperimentSpec, or stack_memory_of_train's stand-in (train, model and a default parallel section)."""
    from backend.spec.stacks import resolve_stack

    stack = str(getattr(spec.train, "stack", "shardlab"))
    if stack == "shardlab":
        return None
    resolved = resolve_stack(spec, "gpu" if device == "cuda" else "cpu")
    r = resolved.values
    kernel = str(r["attention_kernel"])
    flash_model = str(getattr(spec.model, "attention", "math")) == "flash"
    t = spec.train
    fp8 = str(t.precision) == "fp8"
    return StackMemory(mechanism={"megatron": "megatron", "torchtitan": "fsdp2", "deepspeed": "deepspeed"}[stack],
                       param_bytes=DTYPE_BYTES[str(r["param_dtype"])],
                       grad_bytes=DTYPE_BYTES[str(r["grad_reduce_dtype"])],
                       master_bytes=DTYPE_BYTES[str(r["master_dtype"])], optimizer_over_cp=bool(r["optimizer_over_cp"]),
                       loss_parallel=bool(r["loss_parallel"]), te_layer=str(r["elementwise"]) == "fused",
                       fused_attention=kernel != "eager" or flash_model, fp8=fp8,
                       fp8_all_gather=fp8 and bool(getattr(t, "fp8_all_gather", False)),
                       fp8_params=fp8 and str(r["param_dtype"]) == "fp8",
                       recompute_modules=_recompute_modules(t), ep_overlap=bool(r["ep_overlap"]),
                       loss_compiled=bool(r["loss_compiled"]), compiled_blocks=str(r["elementwise"]) == "compiled",
                       te_ring=resolved.cp_ring == "transformer_engine")


def _recompute_modules(train: TrainSpec) -> frozenset[str]:
    """The modules selective recompute checkpoints: Megatron's --recompute-modules as set (an empty list is nothing),
    core_attn when unset (TransformerConfig's default)."""
    modules = getattr(train, "recompute_modules", None)
    return CORE_ATTN_ONLY if modules is None else frozenset(str(x) for x in modules)


@dataclass(frozen=True)
class EngineCompile:
    """What stack shardlab's engine runs under torch.compile (strategies/compiled.py), held as Layout.compiled (read
    through Layout.loss_compiled and blocks_compiled). Other stacks carry both in their StackMemory."""

    loss: bool = False
    """The cross-entropy, not over vocab-parallel logits (whose DTensor loss keeps the eager terms)."""
    blocks: bool = False
    """Every transformer block (elementwise compiled): memory/compiled_block.py's bytes where measured."""


NO_COMPILE = EngineCompile()
"""Nothing compiled: eager blocks and loss."""


def engine_compile(spec: StackSource, device: str) -> EngineCompile:
    """The EngineCompile of a spec on `device` ("cpu" or "cuda"); nothing compiled for the other stacks."""
    from backend.spec.stacks import resolve_stack

    if str(getattr(spec.train, "stack", "shardlab")) != "shardlab":
        return NO_COMPILE
    r = resolve_stack(spec, "gpu" if device == "cuda" else "cpu").values
    return EngineCompile(loss=bool(r["loss_compiled"]) and not (bool(r["loss_parallel"]) and spec.parallel.tp > 1),
                         blocks=str(r["elementwise"]) == "compiled")


def stack_memory_of_train(train: TrainSpec, model: ModelSpec, device: str) -> StackMemory | None:
    """`stack_memory` for a train section alone (the planner: every layout keeps these settings; no stack default
    the memory reads depends on the layout)."""
    spec = SimpleNamespace(train=train, model=model,
                           parallel=SimpleNamespace(zero_stage=0, tp=1, pp=1, dp=1, cp=1, ep=1,
                                                    sequence_parallel=False))
    return stack_memory(spec, device)
